//! Host users' `~/.ssh/authorized_keys`: the keys of live tasks, and nothing else of ours.
//!
//! The manager keeps, in memory, the keys of every live (not yet released) task. Lines the shim
//! writes end with [`MARKER`]; everything else in the file (the user's own keys, comments,
//! garbage) is preserved verbatim and never removed, even when it holds the same key as a task.
//!
//! - [`AuthorizedKeys::add`] registers a task's keys and makes sure each has a marked line
//!   (it never removes a line);
//! - [`AuthorizedKeys::restore`] only registers (no IO), for live tasks after a shim restart;
//! - [`AuthorizedKeys::remove`] forgets a task and rewrites the user's file so that the marked
//!   lines are exactly the keys of the user's live tasks (compared by SHA256 fingerprint), so a
//!   key shared by two tasks stays until the last one is released.
//!
//! Restart contract: after a restart the in-memory set is empty. The engine must `restore` every
//! live task *before* it removes the keys of any finished task; a removal then keeps every key a
//! live task still needs. Because removal is state-based, a marked line left behind by a crash
//! (written, but the task never recorded it) disappears at the user's next removal.
//!
//! Writes are atomic (temp file in `~/.ssh`, fsync, rename, fsync of the directory), keep the
//! file's mode and owner, and leave the previous content in `authorized_keys.bak`. `~/.ssh`
//! (0700) and the file (0600) are created, owned by the user, when missing. One mutex per
//! manager serializes all updates; the manager is meant to be a single instance per process.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};

use fs_err::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use shim_task::{PublicKey, TaskId};

use crate::error::{Error, Result, io_err};

/// The suffix of every line the shim writes (the same marker dstack's Go shim writes).
pub const MARKER: &str = "# added by dstack-shim";

/// A host user as the passwd database describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserEntry {
    /// The home directory.
    pub home: PathBuf,
    /// The user id.
    pub uid: u32,
    /// The primary group id.
    pub gid: u32,
}

/// Looks users up (injectable so tests can use temporary homes).
pub trait UserDb: Send + Sync {
    /// The user's entry; [`Error::UnknownUser`] when there is none.
    fn lookup(&self, user: &str) -> Result<UserEntry>;
}

/// The system's passwd database (`getpwnam_r`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemUserDb;

impl UserDb for SystemUserDb {
    fn lookup(&self, user: &str) -> Result<UserEntry> {
        match nix::unistd::User::from_name(user) {
            Ok(Some(u)) => Ok(UserEntry {
                home: u.dir,
                uid: u.uid.as_raw(),
                gid: u.gid.as_raw(),
            }),
            Ok(None) => Err(Error::UnknownUser {
                user: user.to_owned(),
            }),
            Err(source) => Err(Error::UserLookup {
                user: user.to_owned(),
                source,
            }),
        }
    }
}

/// A fixed user table, for tests: each user maps to a home directory, owned by the current
/// uid/gid unless given otherwise.
#[derive(Debug, Clone, Default)]
pub struct StaticUserDb {
    users: HashMap<String, UserEntry>,
}

impl StaticUserDb {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `user` with home `home`, owned by the current process's uid and gid.
    pub fn with_user(mut self, user: &str, home: impl Into<PathBuf>) -> Self {
        self.users.insert(
            user.to_owned(),
            UserEntry {
                home: home.into(),
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
            },
        );
        self
    }

    /// Adds `user` with an explicit entry.
    pub fn with_entry(mut self, user: &str, entry: UserEntry) -> Self {
        self.users.insert(user.to_owned(), entry);
        self
    }
}

impl UserDb for StaticUserDb {
    fn lookup(&self, user: &str) -> Result<UserEntry> {
        self.users
            .get(user)
            .cloned()
            .ok_or_else(|| Error::UnknownUser {
                user: user.to_owned(),
            })
    }
}

/// Host SSH keys of live tasks. All methods are safe to call concurrently; implementations
/// serialize updates.
#[async_trait]
pub trait AuthorizedKeys: Send + Sync {
    /// Registers `keys` as task `task`'s keys for `user` (replacing what the task had) and makes
    /// sure each has a marked line in the user's file. Never removes a line. On error nothing is
    /// registered for the task and the file is unchanged.
    async fn add(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()>;

    /// Registers a live task's keys without touching any file (after a shim restart, before any
    /// removal).
    fn restore(&self, task: &TaskId, user: &str, keys: &[PublicKey]);

    /// Forgets task `task` and rewrites `user`'s file (and the file of the user the task was
    /// registered with, if another) so that the marked lines are exactly the keys of that user's
    /// live tasks. Idempotent; safe for a task never registered (e.g. after a restart). On
    /// error the task stays forgotten and a retry rewrites again.
    async fn remove(&self, task: &TaskId, user: &str) -> Result<()>;
}

/// The real [`AuthorizedKeys`]: files in the users' homes. Cheap to clone (shared state).
#[derive(Clone)]
pub struct AuthorizedKeysManager {
    inner: Arc<Inner>,
}

struct Inner {
    users: Arc<dyn UserDb>,
    /// Live tasks → (user, keys). The mutex also serializes file updates.
    live: Mutex<BTreeMap<TaskId, (String, Vec<PublicKey>)>>,
}

impl std::fmt::Debug for AuthorizedKeysManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthorizedKeysManager")
            .field("live_tasks", &self.inner.lock().len())
            .finish()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<TaskId, (String, Vec<PublicKey>)>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl AuthorizedKeysManager {
    /// A manager resolving users with `users`.
    pub fn new(users: Arc<dyn UserDb>) -> Self {
        Self {
            inner: Arc::new(Inner {
                users,
                live: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    /// A manager using the system's passwd database.
    pub fn system() -> Self {
        Self::new(Arc::new(SystemUserDb))
    }

    /// Blocking form of [`AuthorizedKeys::add`].
    pub fn add_blocking(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        check_user(user)?;
        let mut live = self.inner.lock();
        let previous = live.insert(task.clone(), (user.to_owned(), keys.to_vec()));
        let result = sync_user(&*self.inner.users, &live, user, false);
        if result.is_err() {
            match previous {
                Some(p) => live.insert(task.clone(), p),
                None => live.remove(task),
            };
        }
        result
    }

    /// Blocking form of [`AuthorizedKeys::remove`].
    pub fn remove_blocking(&self, task: &TaskId, user: &str) -> Result<()> {
        let mut live = self.inner.lock();
        let previous = live.remove(task);
        let mut users = vec![user.to_owned()];
        if let Some((u, _)) = previous {
            if u != user {
                users.push(u);
            }
        }
        let mut first_err = None;
        for u in users.iter().filter(|u| !u.is_empty()) {
            let r = check_user(u).and_then(|()| sync_user(&*self.inner.users, &live, u, true));
            if let Err(e) = r {
                tracing::warn!(task = %task, user = %u, error = %e, "cannot remove host SSH keys");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The tasks whose keys are registered, with their users (for diagnostics and tests).
    pub fn live_tasks(&self) -> Vec<(TaskId, String)> {
        self.inner
            .lock()
            .iter()
            .map(|(t, (u, _))| (t.clone(), u.clone()))
            .collect()
    }
}

#[async_trait]
impl AuthorizedKeys for AuthorizedKeysManager {
    async fn add(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        let this = self.clone();
        let (task, user, keys) = (task.clone(), user.to_owned(), keys.to_vec());
        tokio::task::spawn_blocking(move || this.add_blocking(&task, &user, &keys))
            .await
            .map_err(|source| Error::Join {
                what: "authorized_keys add",
                source,
            })?
    }

    fn restore(&self, task: &TaskId, user: &str, keys: &[PublicKey]) {
        self.inner
            .lock()
            .insert(task.clone(), (user.to_owned(), keys.to_vec()));
    }

    async fn remove(&self, task: &TaskId, user: &str) -> Result<()> {
        let this = self.clone();
        let (task, user) = (task.clone(), user.to_owned());
        tokio::task::spawn_blocking(move || this.remove_blocking(&task, &user))
            .await
            .map_err(|source| Error::Join {
                what: "authorized_keys remove",
                source,
            })?
    }
}

fn check_user(user: &str) -> Result<()> {
    if user.is_empty() || user.contains(['/', '\0']) || user == "." || user == ".." {
        return Err(Error::InvalidUser {
            user: user.to_owned(),
        });
    }
    Ok(())
}

/// The line the shim writes for `key`.
pub fn marked_line(key: &PublicKey) -> String {
    format!("{} {MARKER}", key.line())
}

/// The key of a line the shim wrote, or `None` for any other line.
pub fn parse_marked_line(line: &str) -> Option<PublicKey> {
    let body = line.trim_end().strip_suffix(MARKER)?;
    // The marker must be its own field (an exact suffix after whitespace).
    if !body.ends_with([' ', '\t']) {
        return None;
    }
    PublicKey::parse(body.trim()).ok()
}

/// The new content of a file whose current content is `old`, given the keys the live tasks of
/// its user want. With `prune`, marked lines not wanted are dropped; without, none is dropped.
/// Unmarked lines (including lines that are not UTF-8) are kept byte for byte and in order;
/// marked duplicates are dropped; wanted keys without a marked line are appended.
pub fn render(old: &[u8], wanted: &[PublicKey], prune: bool) -> Vec<u8> {
    let wanted_fps: HashSet<&str> = wanted.iter().map(PublicKey::fingerprint).collect();
    let mut present: HashSet<String> = HashSet::new();
    let mut out = Vec::with_capacity(old.len() + wanted.len() * 128);
    let body = old.strip_suffix(b"\n").unwrap_or(old);
    if !old.is_empty() {
        for line in body.split(|&b| b == b'\n') {
            if let Some(key) = std::str::from_utf8(line).ok().and_then(parse_marked_line) {
                let fp = key.fingerprint();
                if present.contains(fp) || (prune && !wanted_fps.contains(fp)) {
                    continue;
                }
                present.insert(fp.to_owned());
            }
            out.extend_from_slice(line);
            out.push(b'\n');
        }
    }
    for key in wanted {
        if present.insert(key.fingerprint().to_owned()) {
            out.extend_from_slice(marked_line(key).as_bytes());
            out.push(b'\n');
        }
    }
    out
}

/// Brings `user`'s file in line with the live set (see [`render`]).
fn sync_user(
    users: &dyn UserDb,
    live: &BTreeMap<TaskId, (String, Vec<PublicKey>)>,
    user: &str,
    prune: bool,
) -> Result<()> {
    let wanted: Vec<PublicKey> = live
        .values()
        .filter(|(u, _)| u == user)
        .flat_map(|(_, keys)| keys.iter().cloned())
        .collect();
    let entry = users.lookup(user)?;
    let ssh_dir = entry.home.join(".ssh");
    let path = ssh_dir.join("authorized_keys");
    let ssh_dir_exists = check_ssh_dir(&ssh_dir)?;
    // Read without following a symlink (a container with the home bind-mounted could plant
    // one pointing at a secret); mode and owner come from the opened file itself.
    let existing = if ssh_dir_exists {
        read_nofollow(&path)?
    } else {
        None
    };
    let old = existing.as_ref().map(|(bytes, _)| bytes.as_slice());
    let new = render(old.unwrap_or_default(), &wanted, prune);
    if old == Some(new.as_slice()) {
        return Ok(());
    }
    if old.is_none() && wanted.is_empty() {
        return Ok(());
    }
    if !ssh_dir_exists {
        create_ssh_dir(&ssh_dir, &entry)?;
    }
    let (mode, uid, gid) = existing
        .as_ref()
        .map_or((0o600, entry.uid, entry.gid), |(_, m)| {
            (m.permissions().mode() & 0o7777, m.uid(), m.gid())
        });
    if let Some(old) = old {
        let bak = ssh_dir.join("authorized_keys.bak");
        atomic_write(&bak, old, mode, uid, gid)?;
    }
    atomic_write(&path, &new, mode, uid, gid)?;
    tracing::info!(
        user,
        path = %path.display(),
        keys = wanted.len(),
        "authorized_keys updated"
    );
    Ok(())
}

/// Whether `~/.ssh` exists; an error if it is anything but a real directory.
fn check_ssh_dir(dir: &Path) -> Result<bool> {
    match fs_err::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_symlink() => Err(Error::Insecure {
            path: dir.to_owned(),
            why: "it is a symbolic link",
        }),
        Ok(m) if !m.is_dir() => Err(Error::Insecure {
            path: dir.to_owned(),
            why: "it is not a directory",
        }),
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("stat", dir, e)),
    }
}

/// The content and metadata of a regular file, `None` if missing; never follows a symlink.
fn read_nofollow(path: &Path) -> Result<Option<(Vec<u8>, std::fs::Metadata)>> {
    // A clear error for a planted symlink; O_NOFOLLOW below closes the race (ELOOP).
    match fs_err::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(Error::Insecure {
                path: path.to_owned(),
                why: "it is a symbolic link",
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("stat", path, e)),
    }
    let mut f = match fs_err::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open", path, e)),
    };
    let meta = f.metadata().map_err(io_err("stat", path))?;
    if !meta.is_file() {
        return Err(Error::Insecure {
            path: path.to_owned(),
            why: "it is not a regular file",
        });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    std::io::Read::read_to_end(&mut f, &mut bytes).map_err(io_err("read", path))?;
    Ok(Some((bytes, meta)))
}

fn create_ssh_dir(dir: &Path, entry: &UserEntry) -> Result<()> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .map_err(io_err("create", dir))?;
    // The umask may have narrowed the mode. Mode and owner are set through a descriptor
    // opened without following symlinks, so a symlink swapped in meanwhile is never used.
    let d = fs_err::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
        .map_err(io_err("open", dir))?;
    d.set_permissions(std::fs::Permissions::from_mode(0o700))
        .map_err(io_err("chmod", dir))?;
    nix::unistd::fchown(
        std::os::fd::AsRawFd::as_raw_fd(d.file()),
        Some(nix::unistd::Uid::from_raw(entry.uid)),
        Some(nix::unistd::Gid::from_raw(entry.gid)),
    )
    .map_err(|source| Error::Sys {
        action: "chown",
        path: dir.to_owned(),
        source,
    })?;
    if let Some(home) = dir.parent() {
        fsync_dir(home)?;
    }
    Ok(())
}

fn fsync_dir(dir: &Path) -> Result<()> {
    fs_err::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync", dir))
}

/// Writes `data` to `path` atomically: a temp file in the same directory with `mode` and
/// owner `uid:gid`, fsync, rename over `path`, fsync of the directory.
pub(crate) fn atomic_write(path: &Path, data: &[u8], mode: u32, uid: u32, gid: u32) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    // A stale temp file (or anything planted under its name) goes first; then the temp file
    // is created exclusively, never through a symlink.
    match fs_err::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("remove", &tmp, e)),
    }
    let result = (|| {
        let mut f = fs_err::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        // The umask may have narrowed the mode.
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io_err("chmod", &tmp))?;
        if (uid, gid)
            != (
                nix::unistd::geteuid().as_raw(),
                nix::unistd::getegid().as_raw(),
            )
        {
            nix::unistd::fchown(
                std::os::fd::AsRawFd::as_raw_fd(f.file()),
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .map_err(|source| Error::Sys {
                action: "chown",
                path: tmp.clone(),
                source,
            })?;
        }
        f.write_all(data).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        fs_err::rename(&tmp, path).map_err(io_err("rename", &tmp))?;
        fsync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs_err::remove_file(&tmp);
    }
    result
}
