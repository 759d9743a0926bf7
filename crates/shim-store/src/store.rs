//! The store itself: task directories, durable writes, scanning, deletion.

use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use fs_err as fs;
use fs_err::os::unix::fs::OpenOptionsExt as _;
use shim_task::{TaskId, TaskRecord};

use crate::envelope::{self, MAX_RECORD_BYTES};
use crate::error::{RecordError, Result, StoreError};

/// Name of the directory under the shim home that holds one directory per task.
pub const TASKS_DIR: &str = "tasks";
/// Name of a task's state file.
pub const STATE_FILE: &str = "task.json";
/// Name of the raw image pull progress log in a task directory.
pub const PULL_LOG: &str = "pull.log";
/// Name of the subdirectory bind-mounted into the container.
pub const RUNNER_DIR: &str = "runner";

/// Mode of the tasks directory and of each task directory.
pub const DIR_MODE: u32 = 0o700;
/// Mode of the runner directory (the container runs as root and writes there).
pub const RUNNER_DIR_MODE: u32 = 0o755;
/// Mode of the state file.
pub const FILE_MODE: u32 = 0o600;

/// Prefix of the temp files a write creates next to `task.json`.
const TEMP_PREFIX: &str = ".task.json.tmp-";
/// Prefix of a state file moved aside.
const CORRUPT_PREFIX: &str = "task.json.corrupt-";
/// Prefix of a task directory that could not be removed and waits for [`Store::sweep_trash`].
const TRASH_PREFIX: &str = ".trash-";

/// Makes temp names unique within a process (with the store's token across processes).
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The paths of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskPaths {
    /// `<home>/tasks/<id>` (0700): only the shim reads or writes here.
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
    Record(TaskRecord),
    /// A directory without a state file (or whose name is not a task id): left alone, it may
    /// not be ours.
    NoRecord {
        /// The directory.
        dir: PathBuf,
    },
    /// A state file that could not be used. It has been moved aside (the task directory now has
    /// no `task.json`) and a warning logged; the task should be restored from its container.
    Corrupt {
        /// The task (the directory's name).
        id: TaskId,
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
    tasks_dir: PathBuf,
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

impl Store {
    /// Opens the store under `home` (created if missing), creating `<home>/tasks` (0700).
    pub fn open(home: impl AsRef<Path>) -> Result<Self> {
        let home = home.as_ref();
        fs::create_dir_all(home).map_err(io_err("creating the shim home"))?;
        let tasks_dir = home.join(TASKS_DIR);
        if ensure_dir(&tasks_dir, DIR_MODE)? {
            sync_dir(home).map_err(io_err("syncing the shim home"))?;
        }
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Ok(Self {
            tasks_dir,
            token: format!("{}.{}.{nanos}", std::process::id(), now_ms()),
            #[cfg(test)]
            fault: std::sync::Mutex::new(None),
        })
    }

    /// `<home>/tasks`.
    pub fn tasks_dir(&self) -> &Path {
        &self.tasks_dir
    }

    /// The paths of task `id` (nothing is created). Fails only if the joined path would leave
    /// the tasks directory, which a validated id cannot do.
    pub fn paths(&self, id: &TaskId) -> Result<TaskPaths> {
        let dir = self.tasks_dir.join(id.as_str());
        if dir.parent() != Some(self.tasks_dir.as_path())
            || dir.file_name().and_then(|n| n.to_str()) != Some(id.as_str())
        {
            return Err(StoreError::UnsafePath {
                path: dir,
                why: "a task directory must be a direct child of the tasks directory",
            });
        }
        Ok(TaskPaths {
            state_file: dir.join(STATE_FILE),
            pull_log: dir.join(PULL_LOG),
            runner_dir: dir.join(RUNNER_DIR),
            dir,
        })
    }

    /// Creates task `id`'s directory (0700) and its runner directory (0755). An existing
    /// directory without a state file (a submit cut short) is reused; one with a state file
    /// means the id is taken: [`StoreError::TaskExists`].
    pub fn create_task_dir(&self, id: &TaskId) -> Result<TaskPaths> {
        let paths = self.paths(id)?;
        let ctx = || format!("creating the directory of task {id}");
        let created = ensure_dir(&paths.dir, DIR_MODE)?;
        if !created {
            match fs::symlink_metadata(&paths.state_file) {
                Ok(_) => {
                    return Err(StoreError::TaskExists {
                        id: id.clone(),
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
            sync_dir(&self.tasks_dir).map_err(io_err(ctx()))?;
        }
        Ok(paths)
    }

    /// Durably replaces the record of `record.id`: a temp file in the task directory is
    /// written, fsynced and renamed over `task.json` (0600), then the directory is fsynced.
    /// After a crash at any point the state file holds either the old or the new record.
    ///
    /// On error the old record is intact, except when syncing the directory after the rename
    /// failed: then the new record is in place but may not survive a power loss.
    pub fn write(&self, record: &TaskRecord) -> Result<()> {
        let id = &record.id;
        let paths = self.paths(id)?;
        let bytes = envelope::encode(record).map_err(|source| StoreError::Serialize {
            id: id.clone(),
            source,
        })?;
        self.write_atomic(&paths, &bytes).map_err(|source| {
            if source.kind() == io::ErrorKind::NotFound && !paths.dir.is_dir() {
                StoreError::NoTaskDir {
                    id: id.clone(),
                    path: paths.dir.clone(),
                }
            } else {
                StoreError::Io {
                    context: format!("writing the state of task {id}"),
                    source,
                }
            }
        })
    }

    fn write_atomic(&self, paths: &TaskPaths, bytes: &[u8]) -> io::Result<()> {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = paths.dir.join(format!("{TEMP_PREFIX}{}.{n}", self.token));
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
            fs::rename(&tmp, &paths.state_file)
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
        sync_dir(&paths.dir)
    }

    /// Reads task `id`'s record: `None` if it has no state file (or no directory).
    /// An unusable file is [`StoreError::Unreadable`] (and left where it is).
    pub fn read(&self, id: &TaskId) -> Result<Option<TaskRecord>> {
        let paths = self.paths(id)?;
        match read_record(&paths.state_file, id) {
            Ok(r) => Ok(Some(r)),
            Err(RecordError::Io(e)) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StoreError::Unreadable {
                path: paths.state_file,
                source,
            }),
        }
    }

    /// Every directory under the tasks directory, sorted by name: its record, or that it has
    /// none, or that its state file was unusable and has been moved aside. Leftover temp files
    /// of interrupted writes are removed. Trash directories are skipped. Only failing to list
    /// the tasks directory is an error; anything about one entry is logged and reported.
    ///
    /// Call it before writing through this store (it is meant for startup).
    pub fn scan(&self) -> Result<Vec<ScanEntry>> {
        let listing =
            fs::read_dir(&self.tasks_dir).map_err(io_err("listing the task directories"))?;
        let mut dirs = Vec::new();
        for entry in listing {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read an entry of the tasks directory");
                    continue;
                }
            };
            let name = entry.file_name();
            if name.to_str().is_some_and(|n| n.starts_with(TRASH_PREFIX)) {
                continue;
            }
            // DirEntry::file_type does not follow symlinks: a symlink is never a task dir.
            match entry.file_type() {
                Ok(t) if t.is_dir() => dirs.push((name, entry.path())),
                Ok(_) => {
                    tracing::debug!(path = %entry.path().display(), "not a directory; ignored")
                }
                Err(e) => tracing::warn!(error = %e, "cannot stat an entry of the tasks directory"),
            }
        }
        dirs.sort();
        Ok(dirs
            .into_iter()
            .map(|(name, dir)| match name.to_str().map(TaskId::new) {
                Some(Ok(id)) => self.scan_task(id, dir),
                _ => {
                    tracing::debug!(dir = %dir.display(), "not a task id; left alone");
                    ScanEntry::NoRecord { dir }
                }
            })
            .collect())
    }

    fn scan_task(&self, id: TaskId, dir: PathBuf) -> ScanEntry {
        self.remove_stale_temps(&dir);
        let state_file = dir.join(STATE_FILE);
        let error = match read_record(&state_file, &id) {
            Ok(record) => return ScanEntry::Record(record),
            Err(RecordError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                return ScanEntry::NoRecord { dir };
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
                tracing::warn!(task = %id, error = %e, "cannot move an unusable state file aside");
                None
            }
        };
        tracing::warn!(
            task = %id,
            file = %state_file.display(),
            moved_to = ?moved_to,
            error = %error,
            "unusable task state file; the task will be restored from its container if any",
        );
        ScanEntry::Corrupt {
            id,
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

    /// Removes task `id`'s directory. If it cannot be removed entirely (e.g. the container
    /// left files it cannot delete), it is renamed to a trash name for [`Store::sweep_trash`],
    /// so the task is gone either way. An unknown task is `Ok`.
    pub fn delete(&self, id: &TaskId) -> Result<()> {
        let paths = self.paths(id)?;
        let meta = match fs::symlink_metadata(&paths.dir) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(format!("deleting task {id}"))(e)),
        };
        let removed = if meta.is_dir() {
            fs::remove_dir_all(&paths.dir)
        } else {
            fs::remove_file(&paths.dir)
        };
        if let Err(e) = removed {
            let trash = free_name(&self.tasks_dir, &format!("{TRASH_PREFIX}{id}-"));
            tracing::warn!(task = %id, error = %e, trash = %trash.display(), "cannot remove a task directory; moving it to the trash");
            fs::rename(&paths.dir, &trash).map_err(io_err(format!("deleting task {id}")))?;
        }
        if let Err(e) = sync_dir(&self.tasks_dir) {
            tracing::warn!(error = %e, "cannot sync the tasks directory after a delete");
        }
        Ok(())
    }

    /// Removes the trash directories left by [`Store::delete`]. Errors are logged, never
    /// returned. Returns how many were removed.
    pub fn sweep_trash(&self) -> usize {
        let listing = match fs::read_dir(&self.tasks_dir) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the tasks directory to sweep the trash");
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
            let path = entry.path();
            let result = match entry.file_type() {
                Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
                Ok(_) => fs::remove_file(&path),
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => removed += 1,
                Err(e) => tracing::warn!(error = %e, "cannot remove a trash directory"),
            }
        }
        removed
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
fn read_record(path: &Path, id: &TaskId) -> Result<TaskRecord, RecordError> {
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
    envelope::decode(&bytes, id)
}
