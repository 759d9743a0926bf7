//! The store itself: task directories, durable writes, scanning, deletion, migration.

use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use fs_err as fs;
use fs_err::os::unix::fs::OpenOptionsExt as _;
use shim_task::TaskRecord;

use crate::error::{RecordError, Result, StoreError};
use crate::format::{self, Expect, MAX_RECORD_BYTES, Origin};

/// Name of the directory under the shim home that holds one directory per task (upstream's
/// name: `runner/internal/shim/docker.go`, `MakeRunnerDir`).
pub const RUNNERS_DIR: &str = "runners";
/// Name of the per-task directory root of the first release of this shim (migrated at open).
pub const LEGACY_TASKS_DIR: &str = "tasks";
/// Name of a task's state file.
pub const STATE_FILE: &str = "task.json";
/// Name of the raw image pull progress log in a task directory.
pub const PULL_LOG: &str = "pull.log";
/// Name of the subdirectory bind-mounted into the container.
pub const RUNNER_DIR: &str = "runner";
/// Name of the file in the shim home that holds the owner identity.
pub const OWNER_FILE: &str = "owner-id";

/// Mode of the runners directory (as upstream creates it).
pub const RUNNERS_DIR_MODE: u32 = 0o755;
/// Mode of each task directory.
pub const DIR_MODE: u32 = 0o700;
/// Mode of the runner directory (the container runs as root and writes there).
pub const RUNNER_DIR_MODE: u32 = 0o755;
/// Mode of the state file.
pub const FILE_MODE: u32 = 0o600;

/// Prefix of the temp files a write creates next to its target.
const TEMP_PREFIX: &str = ".task.json.tmp-";
/// Prefix of a state file moved aside.
const CORRUPT_PREFIX: &str = "task.json.corrupt-";
/// Prefix of a task directory being deleted (renamed first, then removed; swept at start-up).
pub const TRASH_PREFIX: &str = ".trash-";

/// Makes temp names unique within a process (with the store's token across processes).
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The paths of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskPaths {
    /// `<home>/runners/<container name>` (0700): only the shim reads or writes here.
    pub dir: PathBuf,
    /// `<dir>/task.json` (0600): the record.
    pub state_file: PathBuf,
    /// `<dir>/pull.log`: the daemon's raw pull progress stream.
    pub pull_log: PathBuf,
    /// `<dir>/runner` (0755): the only part bind-mounted into the container. Nothing the shim
    /// reads back lives here.
    pub runner_dir: PathBuf,
}

/// One task directory found by [`Store::scan`].
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "a one-off list at startup; boxing would only burden the caller"
)]
pub enum ScanEntry {
    /// A readable record.
    Record {
        /// The record.
        record: TaskRecord,
        /// Who wrote it ([`Origin::Ours`] or [`Origin::Upstream`]).
        origin: Origin,
    },
    /// A directory without a state file: left alone (it may not be ours, or it may be the
    /// runner directory of an upstream container that has none), unless it is an empty
    /// skeleton (see [`Store::remove_skeleton`]).
    NoRecord {
        /// The directory's name (a container name, if it is a task's).
        name: String,
        /// The directory.
        dir: PathBuf,
        /// It holds nothing but an empty `runner/` (or nothing at all).
        skeleton: bool,
    },
    /// A state file that could not be used. It has been moved aside (the task directory now has
    /// no `task.json`) and a warning logged; the task should be restored from its container.
    Corrupt {
        /// The directory's name (the task's container name).
        name: String,
        /// The task directory.
        dir: PathBuf,
        /// Where the file went (`task.json.corrupt-<unix ms>`); `None` if moving it failed
        /// (logged), in which case it is still `task.json`.
        moved_to: Option<PathBuf>,
        /// Why the file was unusable; its `Display` says e.g. "written by a newer shim
        /// (schema 2)".
        error: RecordError,
    },
}

/// What [`Store::migrate_legacy`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Migration {
    /// Task directories moved from `tasks/<id>` to `runners/<container name>`.
    pub moved: usize,
    /// Legacy directories left where they were (no readable record, or the target exists);
    /// each is logged.
    pub left: usize,
}

/// Which step of a durable write; fault injection points in tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Step {
    CreateTemp,
    Write,
    SyncFile,
    Rename,
    SyncDir,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum FaultKind {
    /// The step fails with an error; the write cleans up and returns it.
    Fail,
    /// The process "dies" at this step: nothing after it runs, no cleanup (a write step writes
    /// half the bytes first).
    Crash,
}

#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fault {
    pub(crate) at: Step,
    pub(crate) kind: FaultKind,
}

/// The durable task store under a shim home. Cheap to share (`Send + Sync`); all methods are
/// blocking (call them from `spawn_blocking` in async code).
///
/// Writes to one task must be serialized by the caller (the engine holds a per-task lock);
/// writes to different tasks may run concurrently.
#[derive(Debug)]
pub struct Store {
    home: PathBuf,
    runners_dir: PathBuf,
    /// Distinguishes this store's temp files from those of a crashed earlier process.
    token: String,
    #[cfg(test)]
    pub(crate) fault: std::sync::Mutex<Option<Fault>>,
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// fsync a directory, making renames and creations in it durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// Makes `path` a real directory (not a symlink) with exactly `mode`, creating it if missing.
/// Returns whether it was created.
fn ensure_dir(path: &Path, mode: u32) -> Result<bool> {
    let created = match fs::create_dir(path) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(io_err("creating a store directory")(e)),
    };
    let meta = fs::symlink_metadata(path).map_err(io_err("checking a store directory"))?;
    if !meta.is_dir() {
        return Err(StoreError::UnsafePath {
            path: path.to_owned(),
            why: "exists and is not a directory",
        });
    }
    if meta.permissions().mode() & 0o7777 != mode {
        fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(io_err("setting a store directory's mode"))?;
    }
    Ok(created)
}

/// A name `<prefix><ms>` (or a later ms) that does not exist in `dir`.
fn free_name(dir: &Path, prefix: &str) -> PathBuf {
    let mut ms = now_ms();
    loop {
        let p = dir.join(format!("{prefix}{ms}"));
        if fs::symlink_metadata(&p).is_err() {
            return p;
        }
        ms += 1;
    }
}

/// Whether `name` may name a task directory: a container name (`<task name>-<8 hex>`, or any
/// name of the same characters: `[A-Za-z0-9_.-]`, starting with a letter or a digit).
pub fn valid_dir_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl Store {
    /// Opens the store under `home` (created if missing, 0700), creating `<home>/runners`
    /// (0755, as upstream creates it).
    pub fn open(home: impl AsRef<Path>) -> Result<Self> {
        let home = home.as_ref();
        if !home.exists() {
            fs::create_dir_all(home).map_err(io_err("creating the shim home"))?;
            fs::set_permissions(home, std::fs::Permissions::from_mode(DIR_MODE))
                .map_err(io_err("setting the shim home's mode"))?;
        }
        let runners_dir = home.join(RUNNERS_DIR);
        if ensure_dir(&runners_dir, RUNNERS_DIR_MODE)? {
            sync_dir(home).map_err(io_err("syncing the shim home"))?;
        }
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Ok(Self {
            home: home.to_owned(),
            runners_dir,
            token: format!("{}.{}.{nanos}", std::process::id(), now_ms()),
            #[cfg(test)]
            fault: std::sync::Mutex::new(None),
        })
    }

    /// The shim home.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// `<home>/runners`.
    pub fn runners_dir(&self) -> &Path {
        &self.runners_dir
    }

    /// The paths of the task whose container is `container_name` (nothing is created). Fails
    /// if the name could leave the runners directory, which a validated task cannot make.
    pub fn paths(&self, container_name: &str) -> Result<TaskPaths> {
        if !valid_dir_name(container_name) {
            return Err(StoreError::UnsafePath {
                path: self.runners_dir.join(container_name),
                why: "a task directory's name must be a container name",
            });
        }
        let dir = self.runners_dir.join(container_name);
        Ok(TaskPaths {
            state_file: dir.join(STATE_FILE),
            pull_log: dir.join(PULL_LOG),
            runner_dir: dir.join(RUNNER_DIR),
            dir,
        })
    }

    /// Creates the task directory (0700) and its runner directory (0755). An existing
    /// directory without a state file (a submit cut short) is reused; one with a state file
    /// means the task exists: [`StoreError::TaskExists`].
    pub fn create_task_dir(&self, container_name: &str) -> Result<TaskPaths> {
        let paths = self.paths(container_name)?;
        let ctx = || format!("creating the directory {}", paths.dir.display());
        let created = ensure_dir(&paths.dir, DIR_MODE)?;
        if !created {
            match fs::symlink_metadata(&paths.state_file) {
                Ok(_) => {
                    return Err(StoreError::TaskExists {
                        name: container_name.to_owned(),
                        path: paths.state_file,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(ctx())(e)),
            }
        }
        ensure_dir(&paths.runner_dir, RUNNER_DIR_MODE)?;
        sync_dir(&paths.dir).map_err(io_err(ctx()))?;
        if created {
            sync_dir(&self.runners_dir).map_err(io_err(ctx()))?;
        }
        Ok(paths)
    }

    /// Removes a task directory that holds nothing but an empty `runner/` (or nothing at
    /// all): what a submit leaves when it is cut short before its first state write, or when
    /// that write fails. Returns whether it was removed; anything else in it is left alone.
    pub fn remove_skeleton(&self, container_name: &str) -> Result<bool> {
        let paths = self.paths(container_name)?;
        if !is_skeleton(&paths.dir) {
            return Ok(false);
        }
        let ctx = || format!("removing the empty task directory {}", paths.dir.display());
        match fs::remove_dir(&paths.runner_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(ctx())(e)),
        }
        fs::remove_dir(&paths.dir).map_err(io_err(ctx()))?;
        if let Err(e) = sync_dir(&self.runners_dir) {
            tracing::warn!(error = %e, "cannot sync the runners directory");
        }
        Ok(true)
    }

    /// Durably replaces the record: a temp file in the task directory is written, fsynced and
    /// renamed over `task.json` (0600), then the directory is fsynced. After a crash at any
    /// point the state file holds either the old or the new record.
    ///
    /// On error the old record is intact, except when syncing the directory after the rename
    /// failed: then the new record is in place but may not survive a power loss.
    pub fn write(&self, record: &TaskRecord) -> Result<()> {
        let paths = self.paths(&record.container_name)?;
        let bytes = format::encode(record).map_err(|source| StoreError::Serialize {
            id: record.id.clone(),
            source,
        })?;
        self.write_atomic(&paths.dir, &paths.state_file, &bytes)
            .map_err(|source| {
                if source.kind() == io::ErrorKind::NotFound && !paths.dir.is_dir() {
                    StoreError::NoTaskDir {
                        id: record.id.clone(),
                        path: paths.dir.clone(),
                    }
                } else {
                    StoreError::Io {
                        context: format!("writing the state of task {}", record.id),
                        source,
                    }
                }
            })
    }

    fn write_atomic(&self, dir: &Path, target: &Path, bytes: &[u8]) -> io::Result<()> {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!("{TEMP_PREFIX}{}.{n}", self.token));
        self.inject(Step::CreateTemp)?;
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        let result = (|| {
            file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
            self.inject_write(&mut file, bytes)?;
            file.write_all(bytes)?;
            self.inject(Step::SyncFile)?;
            file.sync_all()?;
            drop(file);
            self.inject(Step::Rename)?;
            fs::rename(&tmp, target)
        })();
        if let Err(e) = result {
            if !is_crash(&e) {
                if let Err(rm) = fs::remove_file(&tmp) {
                    tracing::warn!(error = %rm, "cannot remove a temp file after a failed write");
                }
            }
            return Err(e);
        }
        self.inject(Step::SyncDir)?;
        sync_dir(dir)
    }

    /// Reads the record of the task whose container is `container_name`: `None` if it has no
    /// state file (or no directory). An unusable file is [`StoreError::Unreadable`] (and left
    /// where it is).
    pub fn read(&self, container_name: &str) -> Result<Option<TaskRecord>> {
        let paths = self.paths(container_name)?;
        match read_record(&paths.state_file, Expect::Container(container_name)) {
            Ok((r, _)) => Ok(Some(r)),
            Err(RecordError::Io(e)) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StoreError::Unreadable {
                path: paths.state_file,
                source,
            }),
        }
    }

    /// Every directory under the runners directory, sorted by name: its record, or that it has
    /// none, or that its state file was unusable and has been moved aside. Leftover temp files
    /// of interrupted writes are removed. Trash and hidden entries are skipped. Only failing to
    /// list the runners directory is an error; anything about one entry is logged and
    /// reported.
    ///
    /// Call it before writing through this store (it is meant for startup).
    pub fn scan(&self) -> Result<Vec<ScanEntry>> {
        let mut out = Vec::new();
        for (name, dir) in list_dirs(&self.runners_dir)? {
            if !valid_dir_name(&name) {
                tracing::debug!(dir = %dir.display(), "not a task directory; left alone");
                continue;
            }
            out.push(self.scan_task(name, dir));
        }
        Ok(out)
    }

    fn scan_task(&self, name: String, dir: PathBuf) -> ScanEntry {
        self.remove_stale_temps(&dir);
        let state_file = dir.join(STATE_FILE);
        let error = match read_record(&state_file, Expect::Container(&name)) {
            Ok((record, Origin::Legacy)) => {
                // Not where a legacy file lives: treat it as ours (a half-done migration
                // rewrites it at the next write).
                return ScanEntry::Record {
                    record,
                    origin: Origin::Ours,
                };
            }
            Ok((record, origin)) => return ScanEntry::Record { record, origin },
            Err(RecordError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                let skeleton = is_skeleton(&dir);
                return ScanEntry::NoRecord {
                    name,
                    dir,
                    skeleton,
                };
            }
            Err(e) => e,
        };
        let target = free_name(&dir, CORRUPT_PREFIX);
        let moved_to = match fs::rename(&state_file, &target) {
            Ok(()) => {
                if let Err(e) = sync_dir(&dir) {
                    tracing::warn!(error = %e, "cannot sync a task directory");
                }
                Some(target)
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot move an unusable state file aside");
                None
            }
        };
        tracing::warn!(
            file = %state_file.display(),
            moved_to = ?moved_to,
            error = %error,
            "unusable task state file; the task will be restored from its container if any",
        );
        ScanEntry::Corrupt {
            name,
            dir,
            moved_to,
            error,
        }
    }

    /// Removes temp files left by a write that a crash interrupted (never this store's own).
    fn remove_stale_temps(&self, dir: &Path) {
        let Ok(listing) = fs::read_dir(dir) else {
            return;
        };
        for entry in listing.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(rest) = name.strip_prefix(TEMP_PREFIX) else {
                continue;
            };
            if rest.starts_with(&format!("{}.", self.token)) {
                continue;
            }
            match fs::remove_file(entry.path()) {
                Ok(()) => {
                    tracing::info!(file = %entry.path().display(), "removed the temp file of an interrupted write")
                }
                Err(e) => tracing::warn!(error = %e, "cannot remove a stale temp file"),
            }
        }
    }

    /// Deletes a task's directory: it is first renamed to a trash name in the same parent
    /// (atomic: from then on the task is gone, even if the shim dies), then removed. A trash
    /// directory that cannot be removed now (e.g. the container left files it cannot delete)
    /// stays for [`Store::sweep_trash`]. An unknown task is `Ok`.
    pub fn delete(&self, container_name: &str) -> Result<()> {
        let paths = self.paths(container_name)?;
        match fs::symlink_metadata(&paths.dir) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(format!("deleting {}", paths.dir.display()))(e)),
        }
        let trash = free_name(
            &self.runners_dir,
            &format!("{TRASH_PREFIX}{container_name}-"),
        );
        fs::rename(&paths.dir, &trash)
            .map_err(io_err(format!("deleting {}", paths.dir.display())))?;
        if let Err(e) = sync_dir(&self.runners_dir) {
            tracing::warn!(error = %e, "cannot sync the runners directory after a delete");
        }
        if let Err(e) = remove_any(&trash) {
            tracing::warn!(trash = %trash.display(), error = %e, "cannot remove a deleted task's directory now; it is swept later");
        }
        Ok(())
    }

    /// Removes the trash directories left by [`Store::delete`] (or by a kill during it).
    /// Errors are logged, never returned. Returns how many were removed.
    pub fn sweep_trash(&self) -> usize {
        let listing = match fs::read_dir(&self.runners_dir) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the runners directory to sweep the trash");
                return 0;
            }
        };
        let mut removed = 0;
        for entry in listing.flatten() {
            if !entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(TRASH_PREFIX))
            {
                continue;
            }
            match remove_any(&entry.path()) {
                Ok(()) => removed += 1,
                Err(e) => tracing::warn!(error = %e, "cannot remove a trash directory"),
            }
        }
        removed
    }

    /// The owner identity stored in the home, if any.
    pub fn owner_id(&self) -> Result<Option<String>> {
        let path = self.home.join(OWNER_FILE);
        match fs::read_to_string(&path) {
            Ok(s) => {
                let id = s.trim();
                if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
                    return Err(StoreError::UnsafePath {
                        path,
                        why: "the owner identity file holds something else than an identity",
                    });
                }
                Ok(Some(id.to_owned()))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("reading the owner identity")(e)),
        }
    }

    /// Stores the owner identity in the home, durably (created once; see SPEC §5).
    pub fn set_owner_id(&self, id: &str) -> Result<()> {
        let path = self.home.join(OWNER_FILE);
        self.write_atomic(&self.home, &path, format!("{id}\n").as_bytes())
            .map_err(io_err("writing the owner identity"))
    }

    /// Whether the home has the first release's `tasks/` directory.
    pub fn has_legacy_layout(&self) -> bool {
        self.home.join(LEGACY_TASKS_DIR).is_dir()
    }

    /// The records of the first release's `tasks/<id>/` directories, read in place (nothing
    /// is changed): used to find the owner identity of such a home before migrating it.
    pub fn legacy_records(&self) -> Vec<TaskRecord> {
        let Ok(dirs) = list_dirs(&self.home.join(LEGACY_TASKS_DIR)) else {
            return Vec::new();
        };
        dirs.into_iter()
            .filter_map(|(name, dir)| {
                read_record(&dir.join(STATE_FILE), Expect::TaskId(&name)).ok()
            })
            .map(|(record, _)| record)
            .collect()
    }

    /// Moves the first release's task directories (`tasks/<id>/`, the record in its old
    /// envelope) to this layout (`runners/<container name>/`, upstream's format), durably and
    /// idempotently: each record is rewritten in the new format in place first, then its
    /// directory is renamed (running containers keep their bind mount: it follows the
    /// directory). A directory without a readable record is left where it is (logged), and
    /// `tasks/` is removed once empty.
    pub fn migrate_legacy(&self) -> Result<Migration> {
        let legacy = self.home.join(LEGACY_TASKS_DIR);
        let mut report = Migration::default();
        let dirs = match list_dirs(&legacy) {
            Ok(d) => d,
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(report);
            }
            Err(e) => return Err(e),
        };
        for (name, dir) in dirs {
            self.remove_stale_temps(&dir);
            let state_file = dir.join(STATE_FILE);
            let record = read_record(&state_file, Expect::TaskId(&name))
                .ok()
                .map(|(record, _)| record);
            let Some(record) = record else {
                let skeleton = is_skeleton(&dir);
                if skeleton {
                    remove_any(&dir).map_err(io_err("removing an empty legacy task directory"))?;
                } else {
                    tracing::warn!(dir = %dir.display(), "legacy task directory without a readable state file left where it is");
                    report.left += 1;
                }
                continue;
            };
            let target = self.paths(&record.container_name)?;
            if fs::symlink_metadata(&target.dir).is_ok() {
                tracing::warn!(from = %dir.display(), to = %target.dir.display(), "cannot migrate a legacy task directory: the target exists; left where it is");
                report.left += 1;
                continue;
            }
            let bytes = format::encode(&record).map_err(|source| StoreError::Serialize {
                id: record.id.clone(),
                source,
            })?;
            self.write_atomic(&dir, &state_file, &bytes)
                .map_err(io_err(format!("rewriting {}", state_file.display())))?;
            fs::rename(&dir, &target.dir).map_err(io_err(format!(
                "moving {} to {}",
                dir.display(),
                target.dir.display()
            )))?;
            sync_dir(&self.runners_dir).map_err(io_err("syncing the runners directory"))?;
            sync_dir(&legacy).map_err(io_err("syncing the legacy tasks directory"))?;
            tracing::info!(task = %record.id, from = %dir.display(), to = %target.dir.display(), "task directory migrated");
            report.moved += 1;
        }
        if report.left == 0 {
            match fs::remove_dir(&legacy) {
                Ok(()) => {
                    if let Err(e) = sync_dir(&self.home) {
                        tracing::warn!(error = %e, "cannot sync the shim home");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot remove the legacy tasks directory"),
            }
        }
        Ok(report)
    }

    #[cfg(test)]
    fn take_fault(&self, step: Step) -> Option<FaultKind> {
        let mut slot = self.fault.lock().ok()?;
        match *slot {
            Some(f) if f.at == step => slot.take().map(|f| f.kind),
            _ => None,
        }
    }

    #[cfg(not(test))]
    #[inline(always)]
    fn take_fault(&self, _step: Step) -> Option<FaultKind> {
        None
    }

    /// Injected fault at `step` (tests only; a no-op otherwise).
    fn inject(&self, step: Step) -> io::Result<()> {
        match self.take_fault(step) {
            None => Ok(()),
            Some(kind) => Err(injected(step, kind)),
        }
    }

    /// The write step's fault: a crash writes half the bytes first.
    fn inject_write(&self, file: &mut fs::File, bytes: &[u8]) -> io::Result<()> {
        match self.take_fault(Step::Write) {
            None => Ok(()),
            Some(kind) => {
                if kind == FaultKind::Crash {
                    file.write_all(&bytes[..bytes.len() / 2])?;
                }
                Err(injected(Step::Write, kind))
            }
        }
    }
}

/// The directories in `dir` (not following symlinks), sorted by name; trash and hidden
/// entries are skipped.
fn list_dirs(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let listing = fs::read_dir(dir).map_err(io_err("listing the task directories"))?;
    let mut dirs = Vec::new();
    for entry in listing {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read an entry of a task directory root");
                continue;
            }
        };
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        // DirEntry::file_type does not follow symlinks: a symlink is never a task dir.
        match entry.file_type() {
            Ok(t) if t.is_dir() => dirs.push((name, entry.path())),
            Ok(_) => tracing::debug!(path = %entry.path().display(), "not a directory; ignored"),
            Err(e) => tracing::warn!(error = %e, "cannot stat an entry of a task directory root"),
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// Whether `dir` holds nothing but an empty `runner/` directory (or nothing at all).
fn is_skeleton(dir: &Path) -> bool {
    let Ok(listing) = fs::read_dir(dir) else {
        return false;
    };
    for entry in listing {
        let Ok(entry) = entry else { return false };
        if entry.file_name() != RUNNER_DIR {
            return false;
        }
        match entry.file_type() {
            Ok(t) if t.is_dir() => {}
            _ => return false,
        }
        match fs::read_dir(entry.path()) {
            Ok(mut inner) => {
                if inner.next().is_some() {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// Removes a directory tree or a file.
fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Marker payload of an injected fault.
#[derive(Debug)]
struct Injected {
    step: Step,
    kind: FaultKind,
}

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected {:?} at {:?}", self.kind, self.step)
    }
}

impl std::error::Error for Injected {}

fn injected(step: Step, kind: FaultKind) -> io::Error {
    io::Error::other(Injected { step, kind })
}

fn is_crash(e: &io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<Injected>())
        .is_some_and(|i| i.kind == FaultKind::Crash)
}

/// Reads and decodes a state file. A missing file is `RecordError::Io(NotFound)`.
fn read_record(path: &Path, expect: Expect<'_>) -> Result<(TaskRecord, Origin), RecordError> {
    let meta = fs::symlink_metadata(path).map_err(RecordError::Io)?;
    if !meta.is_file() {
        return Err(RecordError::NotAFile);
    }
    if meta.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge(meta.len()));
    }
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(RecordError::Io)?;
    let mut bytes = Vec::new();
    file.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(RecordError::Io)?;
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge(bytes.len() as u64));
    }
    format::decode(&bytes, expect)
}
