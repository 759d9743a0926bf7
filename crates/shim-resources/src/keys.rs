//! Host users' `~/.ssh/authorized_keys`: the keys of live tasks, and nothing else of ours.
//!
//! Lines the shim writes end with [`MARKER`]; everything else in the file (the user's own keys,
//! comments, garbage, lines that are not UTF-8) is preserved verbatim and never removed, even
//! when it holds the same key as a task. Keys are compared by SHA256 fingerprint, so any
//! formatting of a key matches.
//!
//! The manager keeps in memory the keys of every live (not yet released) task, and the live
//! tasks whose keys are *unknown* (their state file was unreadable, or they are containers of
//! the upstream shim, which keeps none):
//!
//! - [`AuthorizedKeys::add`] registers a task's keys and makes sure each has a marked line; it
//!   never removes a line;
//! - [`AuthorizedKeys::restore`] registers a live task's keys, [`AuthorizedKeys::hold_unknown`]
//!   a live task whose keys are unknown; both are memory only (after a restart, before any
//!   removal);
//! - [`AuthorizedKeys::remove`] forgets a task (its keys and its hold) and rewrites its user's
//!   file.
//!
//! The rewrite rule for user U (SPEC §7): the marked lines wanted are the keys of U's live
//! tasks. A marked line not wanted is removed when its key belongs to the task being removed
//! (known origin); a marked line of unknown origin (a crash between writing and recording, a
//! task whose record was lost, another shim's) is removed only while no unknown hold covers U
//! (a hold for U, or a hold whose user is unknown too, which covers every user); otherwise it
//! is kept. So key lines go only when they belong to a released task and no live task needs
//! them, and a key shared by two tasks stays until the last one is released.
//!
//! Restart contract: after a restart the memory is empty. The engine registers every live
//! task (`restore` or `hold_unknown`) *before* it removes the keys of any finished task.
//!
//! Safety: the home comes from the passwd database; `~/.ssh` is opened relative to the home
//! with `O_NOFOLLOW|O_DIRECTORY`, and every read and replace happens relative to that handle
//! (`openat`, `renameat`), so a `.ssh` that is a symbolic link is refused and one swapped for a
//! link after it was opened redirects nothing. Writes are atomic (temp file in `~/.ssh`,
//! fsync, rename, fsync of the directory, through [`shim_fs`]), keep the file's mode and owner,
//! and leave the previous content in `authorized_keys.bak`. `~/.ssh` (0700) and the file (0600)
//! are created, owned by the user, when missing. Updates of one user's file are serialized
//! within a manager, which is meant to be a single instance per process; another user's wait
//! for nothing (a home that hangs holds up its own user only).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use shim_fs::{Dir, Owner, WriteOptions};
use shim_task::{PublicKey, TaskId};
use shim_util::{KeyedLocks, error_chain};

use crate::blocking::blocking;
use crate::error::{ResourcesError, Result};

/// The suffix of every line the shim writes.
pub const MARKER: &str = "# added by dstack-shim";

/// The directory under the home.
const SSH_DIR: &str = ".ssh";
/// The file in it.
const FILE: &str = "authorized_keys";
/// The previous content.
const BACKUP: &str = "authorized_keys.bak";
/// The largest `authorized_keys` read (thousands of keys).
const MAX_FILE_BYTES: u64 = 4 << 20;

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
    /// The user's entry; [`ResourcesError::UnknownUser`] when there is none.
    fn lookup(&self, user: &str) -> Result<UserEntry>;
}

/// The system's passwd database (`getpwnam_r`), like upstream's `user.Lookup`: any name it has
/// an entry for is accepted.
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
            Ok(None) => Err(ResourcesError::UnknownUser {
                user: user.to_owned(),
            }),
            Err(source) => Err(ResourcesError::UserLookup {
                user: user.to_owned(),
                source,
            }),
        }
    }
}

/// Host SSH keys of live tasks. All methods are safe to call concurrently; implementations
/// serialize updates.
#[async_trait]
pub trait AuthorizedKeys: Send + Sync {
    /// Registers `keys` as task `task`'s keys for `user` (replacing what the task had, and any
    /// unknown hold of it) and makes sure each has a marked line in the user's file. Never
    /// removes a line. An empty `user` with keys is [`ResourcesError::MissingUser`]. On error nothing
    /// is registered for the task and the file is unchanged.
    async fn add(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()>;

    /// Registers a live task's keys without touching any file (after a shim restart, before
    /// any removal). Replaces an unknown hold of the task.
    fn restore(&self, task: &TaskId, user: &str, keys: &[PublicKey]);

    /// Registers a live task whose keys are unknown (its state file was unreadable, or it is
    /// a container of the upstream shim), without touching any file. Until the task is
    /// removed, marked lines of unknown origin are kept in `user`'s file, or in every user's
    /// file when `user` is `None` (unknown too). Cleared by [`AuthorizedKeys::remove`] of the
    /// task, replaced by `add` or `restore` of it.
    fn hold_unknown(&self, task: &TaskId, user: Option<&str>);

    /// Forgets task `task` (its keys and its unknown hold) and rewrites `user`'s file (and the
    /// file of the user the task was registered with, if another; for a hold without a user,
    /// the file of every user the manager has seen) by the rule of the module documentation; `keys` are the task's keys as recorded (the memory may not know them
    /// after a restart). Idempotent; a no-op for a user that does not exist, has no home or
    /// no `~/.ssh` (nothing of ours can be there). On error the task stays forgotten and a
    /// retry rewrites again.
    async fn remove(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()>;

    /// [`AuthorizedKeys::remove`] for keys the upstream shim added (a task adopted from its
    /// state file): its lines carry no marker, so every line with one of `keys` that no live
    /// task needs goes too, as upstream removes them.
    async fn remove_upstream(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        self.remove(task, user, keys).await
    }
}

/// The real [`AuthorizedKeys`]: files in the users' homes. Cheap to clone (shared state).
#[derive(Clone)]
pub struct AuthorizedKeysManager {
    inner: Arc<Inner>,
}

/// What the manager knows of live tasks.
#[derive(Debug, Default)]
struct State {
    /// Live tasks → (user, keys).
    live: BTreeMap<TaskId, (String, Vec<PublicKey>)>,
    /// Live tasks whose keys are unknown → their user (`None`: unknown too).
    unknown: BTreeMap<TaskId, Option<String>>,
    /// Every user this manager registered a task for or rewrote: where the marked lines kept
    /// for a task of unknown user may be, rewritten when that task is removed.
    seen: BTreeSet<String>,
}

impl State {
    fn wanted(&self, user: &str) -> Vec<PublicKey> {
        self.live
            .values()
            .filter(|(u, _)| u == user)
            .flat_map(|(_, keys)| keys.iter().cloned())
            .collect()
    }

    fn unknown_covers(&self, user: &str) -> bool {
        self.unknown
            .values()
            .any(|u| u.as_deref().is_none_or(|u| u == user))
    }
}

struct Inner {
    users: Arc<dyn UserDb>,
    state: Mutex<State>,
    /// One lock per user, serializing the updates of that user's file (the state lock is
    /// never held across IO): a home that hangs (NFS, a passwd lookup through LDAP) holds
    /// up its own user's updates, not every user's.
    io: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// The same per user for the async callers, taken before their update goes to the
    /// blocking pool: the updates of a user whose home hangs wait here, holding one thread of
    /// the pool between them, not one each (a pool filled with them would stop every file
    /// write of the process).
    queue: KeyedLocks<String>,
    /// When the manager was made, and how long after that a live task's user or home that is
    /// not there fails its keys' removal (retried) instead of counting as nothing to remove.
    started: std::time::Instant,
    grace: std::time::Duration,
}

/// How long after the shim starts a user or home that is not there may still come: at boot a
/// network home (NFS, `_netdev`) or a directory's users (sssd, LDAP) come after the network,
/// which is all the shim's unit waits for. Until then the keys of a live task of that user
/// cannot be taken out of a file not there yet, and are kept to be taken out later.
pub const USER_GRACE: std::time::Duration = std::time::Duration::from_secs(10 * 60);

impl std::fmt::Debug for AuthorizedKeysManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.inner.state();
        f.debug_struct("AuthorizedKeysManager")
            .field("live_tasks", &st.live.len())
            .field("unknown_holds", &st.unknown.len())
            .finish()
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `user`'s update lock (lock it with [`lock`]); dropped from the map once nobody holds
    /// or waits for it.
    fn io(&self, user: &str) -> Arc<Mutex<()>> {
        let mut map = self.io.lock().unwrap_or_else(PoisonError::into_inner);
        map.retain(|_, l| Arc::strong_count(l) > 1);
        map.entry(user.to_owned()).or_default().clone()
    }
}

/// Locks `m`, whatever a panic left in it (it guards nothing but the order of updates).
fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AuthorizedKeysManager {
    /// A manager resolving users with `users`.
    pub fn new(users: Arc<dyn UserDb>) -> Self {
        Self {
            inner: Arc::new(Inner {
                users,
                state: Mutex::default(),
                io: Mutex::default(),
                queue: KeyedLocks::default(),
                started: std::time::Instant::now(),
                grace: USER_GRACE,
            }),
        }
    }

    /// This manager with `grace` instead of [`USER_GRACE`] (called before it is cloned; a
    /// clone keeps the grace it was made with).
    #[must_use]
    pub fn with_user_grace(mut self, grace: std::time::Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.grace = grace;
        }
        self
    }

    /// A manager using the system's passwd database.
    pub fn system() -> Self {
        Self::new(Arc::new(SystemUserDb))
    }

    /// Blocking form of [`AuthorizedKeys::add`].
    pub fn add_blocking(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        if user.is_empty() {
            if keys.is_empty() {
                return Ok(());
            }
            return Err(ResourcesError::MissingUser { keys: keys.len() });
        }
        check_user(user)?;
        let io = self.inner.io(user);
        let _io = lock(&io);
        let (previous, previous_hold, wanted) = {
            let mut st = self.inner.state();
            st.seen.insert(user.to_owned());
            let previous = st
                .live
                .insert(task.clone(), (user.to_owned(), keys.to_vec()));
            let previous_hold = st.unknown.remove(task);
            (previous, previous_hold, st.wanted(user))
        };
        let rewrite = Rewrite {
            wanted: &wanted,
            released: &[],
            prune_unknown: false,
            released_unmarked: &[],
        };
        let result = sync_user(&*self.inner.users, user, &rewrite, true);
        if result.is_err() {
            let mut st = self.inner.state();
            match previous {
                Some(p) => st.live.insert(task.clone(), p),
                None => st.live.remove(task),
            };
            if let Some(h) = previous_hold {
                st.unknown.insert(task.clone(), h);
            }
        }
        result
    }

    /// Blocking form of [`AuthorizedKeys::remove`].
    pub fn remove_blocking(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        self.remove_lines(task, user, keys, false)
    }

    /// Blocking form of [`AuthorizedKeys::remove_upstream`].
    pub fn remove_upstream_blocking(
        &self,
        task: &TaskId,
        user: &str,
        keys: &[PublicKey],
    ) -> Result<()> {
        self.remove_lines(task, user, keys, true)
    }

    fn remove_lines(
        &self,
        task: &TaskId,
        user: &str,
        keys: &[PublicKey],
        upstream: bool,
    ) -> Result<()> {
        let mut released = keys.to_vec();
        let mut users: Vec<String> = Vec::new();
        let mut push = |u: String| {
            if !u.is_empty() && !users.contains(&u) {
                users.push(u);
            }
        };
        push(user.to_owned());
        // The holds are dropped before the rewrites (so the files no longer keep what they
        // covered) and put back if a rewrite fails, so that a retry, which may know neither
        // the user nor the keys, rewrites the same files.
        let (removed_live, removed_unknown, own) = {
            let mut st = self.inner.state();
            let removed_live = st.live.remove(task);
            if let Some((u, k)) = &removed_live {
                released.extend(k.iter().cloned());
                push(u.clone());
            }
            let removed_unknown = st.unknown.remove(task);
            if let Some(Some(u)) = &removed_unknown {
                push(u.clone());
            }
            // The users whose files hold the task's own lines (those a missing home may yet
            // hide), not those rewritten only to prune a hold of unknown user.
            let own: Vec<String> = std::iter::once(user.to_owned())
                .chain(removed_live.as_ref().map(|(u, _)| u.clone()))
                .chain(removed_unknown.clone().flatten())
                .collect();
            match &removed_unknown {
                Some(Some(_)) => {}
                // Its user is unknown too: the marked lines kept for it may be in the file of
                // any user this manager knows; each is rewritten (and pruned unless another
                // hold still covers it).
                Some(None) => st.seen.iter().cloned().for_each(&mut push),
                None => {}
            }
            st.seen.extend(users.iter().cloned());
            (removed_live, removed_unknown, own)
        };
        let mut first_err = None;
        for u in &users {
            if let Err(e) = check_user(u) {
                // Never written: add refuses such a name.
                tracing::debug!(task = %task, error = %e, "no authorized_keys to clean");
                continue;
            }
            let io = self.inner.io(u);
            let _io = lock(&io);
            let (wanted, prune_unknown) = {
                let st = self.inner.state();
                (st.wanted(u), !st.unknown_covers(u))
            };
            let rewrite = Rewrite {
                wanted: &wanted,
                released: &released,
                prune_unknown,
                released_unmarked: if upstream { &released } else { &[] },
            };
            match sync_user(&*self.inner.users, u, &rewrite, false) {
                Ok(()) => {}
                // A live task's keys were written there (or restored as written): a user or
                // home not there yet, soon after the start, fails the removal, retried.
                Err(
                    e @ (ResourcesError::UnknownUser { .. } | ResourcesError::HomeMissing { .. }),
                ) if (removed_live.is_some() || removed_unknown.is_some())
                    && own.contains(u)
                    && self.inner.started.elapsed() < self.inner.grace =>
                {
                    tracing::debug!(task = %task, user = %u, error = %e, "the user's keys cannot be removed yet (their home or account is not there yet); retried");
                    first_err.get_or_insert(e);
                }
                Err(ResourcesError::UnknownUser { .. } | ResourcesError::HomeMissing { .. }) => {
                    tracing::debug!(task = %task, user = %u, "no such user or home; no keys to remove");
                }
                Err(e) => {
                    tracing::warn!(task = %task, user = %u, error = %error_chain(&e), "cannot remove host SSH keys");
                    first_err.get_or_insert(e);
                }
            }
        }
        if first_err.is_some() {
            let mut st = self.inner.state();
            if let Some(hold) = removed_live {
                st.live.insert(task.clone(), hold);
            }
            if let Some(hold) = removed_unknown {
                st.unknown.insert(task.clone(), hold);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The tasks whose keys are registered, with their users (for diagnostics and tests).
    pub fn live_tasks(&self) -> Vec<(TaskId, String)> {
        self.inner
            .state()
            .live
            .iter()
            .map(|(t, (u, _))| (t.clone(), u.clone()))
            .collect()
    }

    /// The live tasks whose keys are unknown, with their users (`None`: unknown).
    pub fn unknown_holds(&self) -> Vec<(TaskId, Option<String>)> {
        self.inner
            .state()
            .unknown
            .iter()
            .map(|(t, u)| (t.clone(), u.clone()))
            .collect()
    }
}

impl AuthorizedKeysManager {
    /// Runs `op` (one of the `*_blocking` methods) for the task's keys on the blocking pool:
    /// it reads and replaces files.
    async fn off_worker(
        &self,
        what: &'static str,
        task: &TaskId,
        user: &str,
        keys: &[PublicKey],
        op: fn(&Self, &TaskId, &str, &[PublicKey]) -> Result<()>,
    ) -> Result<()> {
        // Held by the blocking job, until it ends, even if this future is dropped.
        let queued = self.inner.queue.lock(user.to_owned()).await;
        let this = self.clone();
        let (task, user, keys) = (task.clone(), user.to_owned(), keys.to_vec());
        blocking(what, move || {
            let _queued = queued;
            op(&this, &task, &user, &keys)
        })
        .await
    }
}

#[async_trait]
impl AuthorizedKeys for AuthorizedKeysManager {
    async fn add(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        self.off_worker("authorized_keys add", task, user, keys, Self::add_blocking)
            .await
    }

    fn restore(&self, task: &TaskId, user: &str, keys: &[PublicKey]) {
        let mut st = self.inner.state();
        st.unknown.remove(task);
        if !user.is_empty() {
            st.seen.insert(user.to_owned());
        }
        st.live
            .insert(task.clone(), (user.to_owned(), keys.to_vec()));
    }

    fn hold_unknown(&self, task: &TaskId, user: Option<&str>) {
        let user = user.filter(|u| !u.is_empty()).map(str::to_owned);
        tracing::info!(task = %task, user = ?user,
            "keys of a live task unknown: keeping marked lines of unknown origin");
        let mut st = self.inner.state();
        if let Some(u) = &user {
            st.seen.insert(u.clone());
        }
        st.unknown.insert(task.clone(), user);
    }

    async fn remove_upstream(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        self.off_worker(
            "authorized_keys remove",
            task,
            user,
            keys,
            Self::remove_upstream_blocking,
        )
        .await
    }

    async fn remove(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        self.off_worker(
            "authorized_keys remove",
            task,
            user,
            keys,
            Self::remove_blocking,
        )
        .await
    }
}

/// Refuses user names that could reach another path or inject a line: names containing `/`,
/// NUL or a line break, and `.`/`..`. Any other name is looked up in the passwd database
/// (like upstream's `user.Lookup`, runner/internal/shim/authorized_keys.go).
pub fn check_user(user: &str) -> Result<()> {
    if user.is_empty() || user.contains(['/', '\0', '\n', '\r']) || user == "." || user == ".." {
        return Err(ResourcesError::InvalidUser {
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

/// What a rewrite of one user's file must achieve (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct Rewrite<'a> {
    /// The keys of the user's live tasks: each gets exactly one marked line.
    pub wanted: &'a [PublicKey],
    /// The keys of the tasks being removed (known origin): their marked lines go unless
    /// wanted.
    pub released: &'a [PublicKey],
    /// Whether marked lines of unknown origin (neither wanted nor released) go: true when no
    /// unknown hold covers the user.
    pub prune_unknown: bool,
    /// Keys the upstream shim added without a marker for a task being removed: unmarked lines
    /// with one of them go too, unless wanted (upstream removes every line with the key).
    pub released_unmarked: &'a [PublicKey],
}

impl Rewrite<'_> {
    /// Whether a marked line whose key has fingerprint `fp` stays.
    pub fn keeps(&self, fp: &str) -> bool {
        if self.wanted.iter().any(|k| k.fingerprint() == fp) {
            return true;
        }
        if self.released.iter().any(|k| k.fingerprint() == fp) {
            return false;
        }
        !self.prune_unknown
    }
}

/// The new content of a file whose current content is `old`. Unmarked lines (including lines
/// that are not UTF-8) are kept byte for byte and in order; marked lines are kept or dropped by
/// [`Rewrite::keeps`], and marked duplicates dropped; wanted keys without a marked line are
/// appended. A missing final newline is added.
pub fn render(old: &[u8], rewrite: &Rewrite<'_>) -> Vec<u8> {
    let mut present: HashSet<String> = HashSet::new();
    let mut out = Vec::with_capacity(old.len() + rewrite.wanted.len() * 128);
    let body = old.strip_suffix(b"\n").unwrap_or(old);
    if !old.is_empty() {
        for line in body.split(|&b| b == b'\n') {
            let text = std::str::from_utf8(line).ok();
            if let Some(key) = text.and_then(parse_marked_line) {
                let fp = key.fingerprint();
                if present.contains(fp) || !rewrite.keeps(fp) {
                    continue;
                }
                present.insert(fp.to_owned());
            } else if !rewrite.released_unmarked.is_empty()
                && let Some(key) =
                    text.and_then(|t| PublicKey::parse(t.trim_end_matches('\r')).ok())
            {
                let fp = key.fingerprint();
                let wanted = rewrite.wanted.iter().any(|k| k.fingerprint() == fp);
                if !wanted
                    && rewrite
                        .released_unmarked
                        .iter()
                        .any(|k| k.fingerprint() == fp)
                {
                    continue;
                }
            }
            out.extend_from_slice(line);
            out.push(b'\n');
        }
    }
    for key in rewrite.wanted {
        if present.insert(key.fingerprint().to_owned()) {
            out.extend_from_slice(marked_line(key).as_bytes());
            out.push(b'\n');
        }
    }
    out
}

/// How long a temp file of an `authorized_keys` write must be unchanged to count as left by an
/// interrupted write (a write takes milliseconds; another shim on the host may be in one).
const TEMP_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(600);

/// Removes what writes of the file and its backup cut short by a kill left in `~/.ssh` (temp
/// files holding the keys, which nothing else would ever remove). Failures are logged.
fn remove_interrupted_writes(ssh: &Dir) {
    for name in [FILE, BACKUP] {
        if let Err(e) = ssh.remove_temps_older_than(name, TEMP_MIN_AGE) {
            tracing::debug!(dir = %ssh.path().display(), error = %error_chain(&e),
                "cannot look for the temp files of interrupted writes");
        }
    }
}

/// Applies `rewrite` to `user`'s file, relative to a handle of `~/.ssh` opened without
/// following links. With `create`, a missing `~/.ssh` and file are created; without, a missing
/// `~/.ssh` or file means there is nothing to do, and a missing home is
/// [`ResourcesError::HomeMissing`].
fn sync_user(users: &dyn UserDb, user: &str, rewrite: &Rewrite<'_>, create: bool) -> Result<()> {
    let entry = users.lookup(user)?;
    let owner = Owner::new(entry.uid, entry.gid);
    // The home comes from the passwd database: a trusted path, opened following links.
    let home = match Dir::open(&entry.home) {
        Ok(d) => d,
        Err(e) if !create && e.is_not_found() => {
            return Err(ResourcesError::HomeMissing {
                user: user.to_owned(),
                home: entry.home,
            });
        }
        Err(e) => return Err(e.into()),
    };
    let ssh = home.open_dir(SSH_DIR)?;
    if let Some(ssh) = &ssh {
        remove_interrupted_writes(ssh);
    }
    let existing = match &ssh {
        Some(d) => d.read_file(FILE, MAX_FILE_BYTES)?,
        None => None,
    };
    if existing.is_none() && !create {
        return Ok(());
    }
    let old = existing.as_ref().map(|(bytes, _)| bytes.as_slice());
    let new = render(old.unwrap_or_default(), rewrite);
    if old == Some(new.as_slice()) || (old.is_none() && new.is_empty()) {
        return Ok(());
    }
    let ssh = match ssh {
        Some(d) => d,
        None => home.create_dir(SSH_DIR, 0o700, Some(owner))?.0,
    };
    // An existing file keeps its mode and owner; a new one is the user's, 0600.
    let (mode, owner) = existing
        .as_ref()
        .map_or((0o600, owner), |(_, info)| (info.mode, info.owner()));
    let opts = WriteOptions::new(mode).owner(owner);
    if let Some(old) = old {
        ssh.write_atomic(BACKUP, old, &opts)?;
    }
    ssh.write_atomic(FILE, &new, &opts)?;
    tracing::info!(
        user,
        path = %ssh.join(FILE).display(),
        keys = rewrite.wanted.len(),
        "authorized_keys updated"
    );
    Ok(())
}
