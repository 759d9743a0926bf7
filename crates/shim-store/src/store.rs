//! The store itself: task directories, durable writes, scanning, deletion, migration.

use std::collections::BTreeSet;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use fs_err as fs;
use shim_fs::{Dir, FileKind, GroupStats, GroupSync, PreparedDir, WriteOptions};
use shim_task::TaskRecord;
use shim_util::error_chain;

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

/// Prefix of a state file moved aside.
const CORRUPT_PREFIX: &str = "task.json.corrupt-";
/// Prefix of a task directory being deleted (renamed first, then removed; swept at start-up).
pub const TRASH_PREFIX: &str = ".trash-";
/// Prefix of a spare task directory: made ahead of a submit (its `runner/` and an empty
/// `task.json`, fsynced), so that the submit's record costs one fsync of the file and one
/// fsync of `runners/` (shared with concurrent submits). Leftovers are removed at open.
pub const SPARE_PREFIX: &str = ".spare-";
/// Prefix of the mark, beside a task directory, that its container mounts it whole (upstream's
/// containers from before state files): a state file in it is the container's to write and is
/// never read ([`ScanEntry::MountedWhole`]), even once the container is gone.
pub const MOUNTED_WHOLE_PREFIX: &str = ".mounted-whole-";
/// How many spare task directories [`Store::prepare_spares`] keeps ready.
pub const SPARES: usize = 8;

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
    /// A state file that could not be used. One that could not be parsed has been moved aside
    /// (the task directory now has no `task.json`); one that could not be read now (an I/O
    /// error: it may read at the next start) is left in place. A warning is logged either way;
    /// the task should be restored from its container.
    Corrupt {
        /// The directory's name (the task's container name).
        name: String,
        /// The task directory.
        dir: PathBuf,
        /// Where the file went (`task.json.corrupt-<unix ms>`); `None` if it was not moved
        /// (unreadable now, or moving it failed: logged), in which case it is still `task.json`.
        moved_to: Option<PathBuf>,
        /// Why the file was unusable; its `Display` says e.g. "written by a newer shim
        /// (schema 2)".
        error: RecordError,
    },
    /// A directory marked as mounted whole by its container ([`Store::mark_mounted_whole`]):
    /// whatever state file it holds was the container's to write, and is not read.
    MountedWhole {
        /// The directory's name (the task's container name).
        name: String,
        /// The task directory.
        dir: PathBuf,
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

/// The durable task store under a shim home. Cheap to share (`Send + Sync`); all methods are
/// blocking (call them from `spawn_blocking` in async code).
///
/// The home and the runners directory are opened once, as directory handles (`shim_fs::Dir`);
/// a task directory is opened relative to the runners directory, never through a symbolic
/// link, and its files are read and replaced relative to that handle.
///
/// Writes to one task must be serialized by the caller (the engine holds a per-task lock);
/// writes to different tasks may run concurrently.
#[derive(Debug)]
pub struct Store {
    home: PathBuf,
    runners_dir: PathBuf,
    /// The home (opened following links: the operator's path).
    home_handle: Dir,
    /// `<home>/runners`, never through a link.
    runners: Dir,
    /// The fsyncs of `runners` (which make task directories appear and go durably), shared
    /// by concurrent callers: one group commit for concurrent submits.
    runners_sync: GroupSync,
    /// Spare task directories, ready for submits ([`SPARE_PREFIX`]).
    spares: Mutex<Vec<PreparedDir>>,
    /// The number in the next spare's name.
    next_spare: AtomicU64,
    /// Faults injected into this store's atomic writes (tests: [`Store::with_faults`]).
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) faults: std::sync::Arc<shim_fs::fault::Faults>,
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

/// The context of an error while writing `record`'s state.
fn writing(record: &TaskRecord) -> String {
    format!("writing the state of task {}", record.id)
}

/// A shim-fs error as a store error: a link or a file where a directory must be is
/// [`StoreError::UnsafePath`]; anything else is [`StoreError::Io`] whose source keeps the
/// error kind (not found, disk full) and the shim-fs error (its path and step) as the message.
fn fs_err_ctx(context: impl Into<String>) -> impl FnOnce(shim_fs::FsError) -> StoreError {
    let context = context.into();
    move |e| match e {
        shim_fs::FsError::WrongType {
            path,
            expected: "a directory",
            ..
        } => StoreError::UnsafePath {
            path,
            why: "exists and is not a directory",
        },
        e => StoreError::Io {
            context,
            source: fs_io(e),
        },
    }
}

/// A shim-fs error as an `io::Error` of the same kind.
fn fs_io(e: shim_fs::FsError) -> io::Error {
    io::Error::new(e.io_kind().unwrap_or(io::ErrorKind::Other), e)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Opens `parent/name` as a directory (never through a symbolic link: a link or a file there
/// is [`StoreError::UnsafePath`]) with exactly `mode`, creating it (durably) if missing.
/// Returns the handle and whether it was created.
fn ensure_dir(parent: &Dir, name: &str, mode: u32) -> Result<(Dir, bool)> {
    ensure_dir_with(parent, name, mode, true)
}

/// [`ensure_dir`]; `sync: false` leaves the creation to `parent`'s next fsync.
fn ensure_dir_with(parent: &Dir, name: &str, mode: u32, sync: bool) -> Result<(Dir, bool)> {
    let ctx = || format!("creating the directory {}", parent.join(name).display());
    let created = if sync {
        parent.create_dir(name, mode, None)
    } else {
        parent.create_dir_unsynced(name, mode, None)
    };
    let (dir, created) = created.map_err(fs_err_ctx(ctx()))?;
    if !created && dir.info().map_err(fs_err_ctx(ctx()))?.mode != mode {
        dir.set_mode(mode).map_err(fs_err_ctx(ctx()))?;
    }
    Ok((dir, created))
}

/// A name `<prefix><ms>` (or a later ms) that does not exist in `dir`.
fn free_name(dir: &Dir, prefix: &str) -> String {
    let mut ms = now_ms();
    loop {
        let name = format!("{prefix}{ms}");
        if !matches!(dir.stat(&name), Ok(Some(_))) {
            return name;
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
        Self::open_with(home.as_ref(), |dir| dir)
    }

    /// [`Store::open`], every durable operation of the store (from opening on) recorded into
    /// `recorder`, whose root is `home` or a directory above it (crash-state tests:
    /// `shim_fs::crash`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn open_recorded(
        home: impl AsRef<Path>,
        recorder: std::sync::Arc<shim_fs::crash::Recorder>,
    ) -> Result<Self> {
        Self::open_with(home.as_ref(), |dir| dir.with_recorder(recorder))
    }

    /// Opens the store, `attach` given the home's handle (from which every other handle of
    /// the store is opened).
    fn open_with(home: &Path, attach: impl FnOnce(Dir) -> Dir) -> Result<Self> {
        if !home.exists() {
            fs::create_dir_all(home).map_err(io_err("creating the shim home"))?;
            fs::set_permissions(home, std::fs::Permissions::from_mode(DIR_MODE))
                .map_err(io_err("setting the shim home's mode"))?;
        }
        let home_handle = attach(Dir::open(home).map_err(fs_err_ctx("opening the shim home"))?);
        // Created durably (the home is fsynced) when missing.
        let (runners, _) = ensure_dir(&home_handle, RUNNERS_DIR, RUNNERS_DIR_MODE)?;
        // A crash while writing the owner identity leaves a temp file there.
        if let Err(e) = home_handle.remove_stale_temps(OWNER_FILE) {
            tracing::warn!(error = %error_chain(&e), "cannot remove stale temp files from the shim home");
        }
        remove_spares(&runners);
        Ok(Self {
            home: home.to_owned(),
            runners_dir: home.join(RUNNERS_DIR),
            home_handle,
            runners,
            runners_sync: GroupSync::new(),
            spares: Mutex::new(Vec::new()),
            next_spare: AtomicU64::new(0),
            #[cfg(any(test, feature = "test-support"))]
            faults: std::sync::Arc::default(),
        })
    }

    /// Makes spare task directories until [`SPARES`] are ready (each: `mkdir`, its
    /// `runner/` and an empty `task.json`, one fsync of it); how many it made. Blocking;
    /// meant to run in the background after submits and at start-up, so that a submit finds
    /// one ([`Store::create`] makes one itself when none is ready, at one more fsync).
    pub fn prepare_spares(&self) -> Result<usize> {
        self.prepare_spares_up_to(SPARES)
    }

    /// [`Store::prepare_spares`] up to `count` ready ones.
    pub fn prepare_spares_up_to(&self, count: usize) -> Result<usize> {
        let want = count.saturating_sub(self.spares_ready());
        for made in 0..want {
            let spare = self.make_spare()?;
            let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
            if spares.len() >= count {
                drop(spares);
                if let Err(e) = spare.discard(&self.runners) {
                    tracing::warn!(error = %error_chain(&e), "cannot remove a spare task directory");
                }
                return Ok(made);
            }
            spares.push(spare);
        }
        Ok(want)
    }

    /// How many spare task directories are ready.
    pub fn spares_ready(&self) -> usize {
        self.spares.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// One new spare task directory.
    fn make_spare(&self) -> Result<PreparedDir> {
        let ctx = || {
            format!(
                "preparing a task directory in {}",
                self.runners_dir.display()
            )
        };
        let mut tries = 0;
        loop {
            let n = self.next_spare.fetch_add(1, Ordering::Relaxed);
            let made = self.runners.prepare_dir(
                format!("{SPARE_PREFIX}{n}"),
                DIR_MODE,
                &[(RUNNER_DIR, RUNNER_DIR_MODE)],
                STATE_FILE,
                FILE_MODE,
            );
            match made {
                Err(e) if e.io_kind() == Some(io::ErrorKind::AlreadyExists) && tries < 16 => {
                    tries += 1;
                }
                other => return other.map_err(fs_err_ctx(ctx())),
            }
        }
    }

    /// A ready spare, or a new one.
    fn take_spare(&self) -> Result<PreparedDir> {
        let ready = self.spares.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match ready {
            Some(spare) => Ok(spare),
            None => self.make_spare(),
        }
    }

    /// How many callers the fsyncs of the runners directory had, and how many fsyncs ran
    /// (a submit, a delete and a new task directory are one caller each).
    pub fn runners_commits(&self) -> GroupStats {
        self.runners_sync.stats()
    }

    /// Tests: the next fsync of the runners directory waits (at most `bound`) until
    /// `callers` calls share it ([`GroupSync::gather_next`]).
    #[cfg(any(test, feature = "test-support"))]
    pub fn gather_next_commit(&self, callers: usize, bound: std::time::Duration) {
        self.runners_sync.gather_next(callers, bound);
    }

    /// This store with `faults` injected into its writes (a full disk:
    /// [`shim_fs::fault::Faults::set_full`]).
    #[cfg(any(test, feature = "test-support"))]
    #[must_use]
    pub fn with_faults(mut self, faults: std::sync::Arc<shim_fs::fault::Faults>) -> Self {
        self.faults = faults;
        self
    }

    /// fsyncs the runners directory, sharing the fsync with concurrent callers.
    fn commit_runners(&self) -> std::result::Result<(), shim_fs::FsError> {
        #[cfg(any(test, feature = "test-support"))]
        self.faults
            .fire(shim_fs::Step::SyncDir, &self.runners_dir)?;
        self.runners_sync.sync(&self.runners)
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

    /// How every file of the store is written: exactly 0600.
    fn write_options(&self) -> WriteOptions {
        let opts = WriteOptions::new(FILE_MODE);
        #[cfg(any(test, feature = "test-support"))]
        let opts = opts.faults(self.faults.clone());
        opts
    }

    /// Creates the task directory (0700) and its runner directory (0755). An existing
    /// directory without a state file (a submit cut short) is reused; one with a state file
    /// means the task exists: [`StoreError::TaskExists`]. The task directory is durable on
    /// return; its `runner/` entry becomes durable with the first [`Store::write`] (which
    /// fsyncs the task directory). A crash before that write leaves at most a skeleton, which
    /// the scan at start-up recognises. [`Store::create`] does both with one fsync less.
    pub fn create_task_dir(&self, container_name: &str) -> Result<TaskPaths> {
        let (paths, _) = self.make_task_dir(container_name)?;
        self.commit_runners()
            .map_err(fs_err_ctx(format!("creating {}", paths.dir.display())))?;
        Ok(paths)
    }

    /// A new task: its directory (with `runner/`) and its first record, durable on return,
    /// at one fsync of the file and one of the runners directory, which concurrent creates
    /// share (a group commit). A spare directory ([`Store::prepare_spares`]; made now, at one
    /// fsync more, when none is ready) gets the record written into its `task.json` and
    /// fsynced, is renamed to the task's name, and the runners directory is fsynced. A crash
    /// before the return leaves the complete task or nothing under its name (a spare, which
    /// the next open removes); never a directory without its record.
    ///
    /// Where the name exists already (a skeleton a cut-short submit left, reused; or a task:
    /// [`StoreError::TaskExists`]) the record is written into that directory instead.
    ///
    /// On error no state file is left (one published before a failed fsync is removed again,
    /// so a failed submit does not come back as a task at the next start-up), but the
    /// directory may be, as a skeleton ([`Store::remove_skeleton`]).
    pub fn create(&self, record: &TaskRecord) -> Result<TaskPaths> {
        let name = &record.container_name;
        let paths = self.paths(name)?;
        let bytes = format::encode(record).map_err(|source| StoreError::Serialize {
            id: record.id.clone(),
            source,
        })?;
        let taken = self
            .runners
            .stat(name)
            .map_err(fs_err_ctx(writing(record)))?
            .is_some();
        let dir = if taken {
            None
        } else {
            let spare = self.take_spare()?;
            match spare.publish(&self.runners, name, &bytes, &self.write_options()) {
                Ok(dir) => Some(dir),
                // Made meanwhile: decided below.
                Err(e) if e.io_kind() == Some(io::ErrorKind::AlreadyExists) => None,
                // The spare was removed behind this store (a second `Store::open` on the home
                // removes spares): the directory is made below instead.
                Err(e) if e.io_kind() == Some(io::ErrorKind::NotFound) => None,
                Err(e) => return Err(fs_err_ctx(writing(record))(e)),
            }
        };
        let dir = match dir {
            Some(dir) => dir,
            None => {
                let (_, dir) = self.make_task_dir(name)?;
                let written = dir.write_atomic(STATE_FILE, &bytes, &self.write_options());
                if let Err(e) = written {
                    // Renamed into place before the directory's fsync failed: removed again.
                    remove_failed_state_file(&dir, &paths);
                    return Err(fs_err_ctx(writing(record))(e));
                }
                dir
            }
        };
        if let Err(e) = self.commit_runners() {
            remove_failed_state_file(&dir, &paths);
            return Err(fs_err_ctx(writing(record))(e));
        }
        Ok(paths)
    }

    /// The task directory and its `runner/`, made if missing (not yet durable: the caller
    /// commits the runners directory); [`StoreError::TaskExists`] when it holds a state file.
    fn make_task_dir(&self, container_name: &str) -> Result<(TaskPaths, Dir)> {
        let paths = self.paths(container_name)?;
        let (dir, created) = ensure_dir_with(&self.runners, container_name, DIR_MODE, false)?;
        if !created {
            let state = dir.stat(STATE_FILE).map_err(fs_err_ctx(format!(
                "creating the directory {}",
                paths.dir.display()
            )))?;
            if state.is_some() {
                return Err(StoreError::TaskExists {
                    name: container_name.to_owned(),
                    path: paths.state_file,
                });
            }
        }
        ensure_dir_with(&dir, RUNNER_DIR, RUNNER_DIR_MODE, false)?;
        Ok((paths, dir))
    }

    /// Removes a task directory that holds nothing but an empty `runner/` (or nothing at
    /// all): what a submit leaves when it is cut short before its first state write, or when
    /// that write fails. Returns whether it was removed; anything else in it is left alone.
    pub fn remove_skeleton(&self, container_name: &str) -> Result<bool> {
        let paths = self.paths(container_name)?;
        let Ok(Some(dir)) = self.runners.open_dir(container_name) else {
            return Ok(false);
        };
        if !is_skeleton(&dir) {
            return Ok(false);
        }
        let ctx = || format!("removing the empty task directory {}", paths.dir.display());
        dir.remove_dir(RUNNER_DIR).map_err(fs_err_ctx(ctx()))?;
        let removed = self
            .runners
            .remove_dir(container_name)
            .map_err(fs_err_ctx(ctx()))?;
        if let Err(e) = self.commit_runners() {
            tracing::warn!(error = %error_chain(&e), "cannot sync the runners directory");
        }
        Ok(removed)
    }

    /// Durably replaces the record (`shim_fs::Dir::write_atomic` in the task directory,
    /// opened without following links): a temp file in the task directory is written,
    /// fsynced and renamed over `task.json` (0600), then the directory is fsynced. After a
    /// crash at any point the state file holds either the old or the new record.
    ///
    /// On error the old record is intact, except when syncing the directory after the rename
    /// failed: then the new record is in place but may not survive a power loss.
    pub fn write(&self, record: &TaskRecord) -> Result<()> {
        let paths = self.paths(&record.container_name)?;
        let dir = match self.runners.open_dir(&record.container_name) {
            Ok(Some(dir)) => dir,
            Ok(None) => {
                return Err(StoreError::NoTaskDir {
                    id: record.id.clone(),
                    path: paths.dir,
                });
            }
            Err(e) => {
                return Err(fs_err_ctx(writing(record))(e));
            }
        };
        self.write_into(&dir, record)
    }

    /// Writes `record` atomically into its open task directory `dir`.
    fn write_into(&self, dir: &Dir, record: &TaskRecord) -> Result<()> {
        let bytes = format::encode(record).map_err(|source| StoreError::Serialize {
            id: record.id.clone(),
            source,
        })?;
        dir.write_atomic(STATE_FILE, &bytes, &self.write_options())
            .map_err(fs_err_ctx(writing(record)))
    }

    /// Reads the record of the task whose container is `container_name`: `None` if it has no
    /// state file (or no directory). An unusable file is [`StoreError::Unreadable`] (and left
    /// where it is).
    pub fn read(&self, container_name: &str) -> Result<Option<TaskRecord>> {
        let paths = self.paths(container_name)?;
        let unreadable = |source| StoreError::Unreadable {
            path: paths.state_file.clone(),
            source,
        };
        let dir = match self.runners.open_dir(container_name) {
            Ok(Some(dir)) => dir,
            Ok(None) => return Ok(None),
            Err(e) => return Err(unreadable(RecordError::Io(fs_io(e)))),
        };
        match read_record(&dir, Expect::Container(container_name)) {
            Ok(r) => Ok(r.map(|(r, _)| r)),
            Err(source) => Err(unreadable(source)),
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
        let mut marked = self.mounted_whole_marks();
        let mut out = Vec::new();
        for name in list_dirs(&self.runners)? {
            let dir = self.runners_dir.join(&name);
            if !valid_dir_name(&name) {
                tracing::debug!(dir = %dir.display(), "not a task directory; left alone");
                continue;
            }
            if marked.remove(&name) {
                out.push(ScanEntry::MountedWhole { name, dir });
                continue;
            }
            out.push(self.scan_task(name, dir));
        }
        // Marks whose directory is gone (a delete cut between the two).
        for name in marked {
            self.forget_mounted_whole(&name);
        }
        Ok(out)
    }

    /// Moves the state file of task directory `container_name` aside
    /// (`task.json.corrupt-<ms>`), as [`Store::scan`] moves an unusable one: for a file that
    /// could not be read at the scan (left in place) whose task is restored from its
    /// container, so that the record written for it next does not replace those bytes.
    /// Where it went; `None` when there is no such directory or file, or it could not be
    /// moved (logged).
    pub fn set_aside_state_file(&self, container_name: &str) -> Result<Option<PathBuf>> {
        let paths = self.paths(container_name)?;
        let Ok(Some(handle)) = self.runners.open_dir(container_name) else {
            return Ok(None);
        };
        match handle.stat(STATE_FILE) {
            Ok(Some(_)) => Ok(set_aside(&handle, &paths.dir)),
            _ => Ok(None),
        }
    }

    /// Marks the task directory `container_name` as mounted whole by its container, durably:
    /// from then on [`Store::scan`] does not read its state file, until [`Store::delete`].
    pub fn mark_mounted_whole(&self, container_name: &str) -> Result<()> {
        let paths = self.paths(container_name)?;
        self.runners
            .create_new_atomic(
                format!("{MOUNTED_WHOLE_PREFIX}{container_name}"),
                b"",
                &self.write_options(),
            )
            .map_err(fs_err_ctx(format!(
                "marking {} as mounted whole",
                paths.dir.display()
            )))?;
        Ok(())
    }

    /// The container names marked by [`Store::mark_mounted_whole`] (none when the runners
    /// directory cannot be listed: logged).
    fn mounted_whole_marks(&self) -> BTreeSet<String> {
        match self.runners.names() {
            Ok(names) => names
                .iter()
                .filter_map(|n| n.to_str()?.strip_prefix(MOUNTED_WHOLE_PREFIX))
                .map(str::to_owned)
                .collect(),
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot list the runners directory for its marks");
                BTreeSet::new()
            }
        }
    }

    /// Removes the mark of `container_name`, if any (a failure is logged: the next start
    /// removes a mark whose directory is gone).
    fn forget_mounted_whole(&self, container_name: &str) {
        let mark = format!("{MOUNTED_WHOLE_PREFIX}{container_name}");
        if let Err(e) = self.runners.remove_file(&mark) {
            tracing::warn!(error = %error_chain(&e), "cannot remove a task directory's mark");
        }
    }

    fn scan_task(&self, name: String, dir: PathBuf) -> ScanEntry {
        let handle = match self.runners.open_dir(&name) {
            Ok(Some(handle)) => handle,
            Ok(None) | Err(_) => {
                tracing::warn!(dir = %dir.display(), "cannot open a task directory; left alone");
                return ScanEntry::NoRecord {
                    name,
                    dir,
                    skeleton: false,
                };
            }
        };
        // Temp files left by a write that a crash interrupted (never this process's own).
        if let Err(e) = handle.remove_stale_temps(STATE_FILE) {
            tracing::warn!(error = %error_chain(&e), "cannot remove stale temp files");
        }
        let state_file = dir.join(STATE_FILE);
        let read = read_record(&handle, Expect::Container(&name));
        #[cfg(any(test, feature = "test-support"))]
        let read = match self.faults.fire(shim_fs::Step::Read, &state_file) {
            Ok(()) => read,
            Err(e) => Err(RecordError::Io(fs_io(e))),
        };
        let error = match read {
            Ok(Some((record, Origin::Legacy))) => {
                // Not where a legacy file lives: treat it as ours (a half-done migration
                // rewrites it at the next write).
                return ScanEntry::Record {
                    record,
                    origin: Origin::Ours,
                };
            }
            Ok(Some((record, origin))) => return ScanEntry::Record { record, origin },
            Ok(None) => {
                let skeleton = is_skeleton(&handle);
                return ScanEntry::NoRecord {
                    name,
                    dir,
                    skeleton,
                };
            }
            // Not known to be corrupt: a bad sector, a full file table or memory, a stale
            // handle may read at the next start. Moved aside, the task's volumes and keys
            // would be forgotten for good.
            Err(e @ RecordError::Io(_)) => return unreadable_now(name, dir, e),
            Err(e) => e,
        };
        let moved_to = set_aside(&handle, &dir);
        tracing::warn!(
            file = %state_file.display(),
            moved_to = ?moved_to,
            error = %error_chain(&error),
            "unusable task state file; the task will be restored from its container if any",
        );
        ScanEntry::Corrupt {
            name,
            dir,
            moved_to,
            error,
        }
    }

    /// Deletes a task's directory: it is first renamed to a trash name in the same parent and
    /// the parent fsynced (from then on the task is gone, even if the shim dies), then removed.
    /// A trash directory that cannot be removed now (e.g. the container left files it cannot
    /// delete) stays for [`Store::sweep_trash`]. An unknown task is `Ok` once the parent is
    /// fsynced (a retry after a failed fsync finds the name gone: the rename is made durable
    /// then). A failed fsync is the error: the task may be back after a crash.
    pub fn delete(&self, container_name: &str) -> Result<()> {
        let paths = self.paths(container_name)?;
        let ctx = || format!("deleting {}", paths.dir.display());
        if self
            .runners
            .stat(container_name)
            .map_err(fs_err_ctx(ctx()))?
            .is_none()
        {
            self.commit_runners().map_err(fs_err_ctx(ctx()))?;
            self.forget_mounted_whole(container_name);
            return Ok(());
        }
        let trash = free_name(&self.runners, &format!("{TRASH_PREFIX}{container_name}-"));
        self.runners
            .rename(container_name, &self.runners, &trash)
            .map_err(fs_err_ctx(ctx()))?;
        // Not durable yet: the trash stays (swept later) and the caller hears of it.
        self.commit_runners().map_err(fs_err_ctx(ctx()))?;
        if let Err(e) = self.runners.remove_tree(&trash) {
            tracing::warn!(trash = %self.runners.join(&trash).display(), error = %error_chain(&e), "cannot remove a deleted task's directory now; it is swept later");
        }
        self.forget_mounted_whole(container_name);
        Ok(())
    }

    /// Removes the trash directories left by [`Store::delete`] (or by a kill during it).
    /// Errors are logged, never returned. Returns how many were removed.
    pub fn sweep_trash(&self) -> usize {
        let names = match self.runners.names() {
            Ok(names) => names,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot list the runners directory to sweep the trash");
                return 0;
            }
        };
        let mut removed = 0;
        for name in names {
            if !name.to_str().is_some_and(|n| n.starts_with(TRASH_PREFIX)) {
                continue;
            }
            match self.runners.remove_tree(&name) {
                Ok(_) => removed += 1,
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "cannot remove a trash directory")
                }
            }
        }
        removed
    }

    /// The owner identity stored in the home, if any.
    pub fn owner_id(&self) -> Result<Option<String>> {
        let read = self
            .home_handle
            .read_file(OWNER_FILE, 4096)
            .map_err(fs_err_ctx("reading the owner identity"))?;
        let Some((bytes, _)) = read else {
            return Ok(None);
        };
        let id = String::from_utf8_lossy(&bytes);
        let id = id.trim();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(StoreError::UnsafePath {
                path: self.home.join(OWNER_FILE),
                why: "the owner identity file holds something else than an identity",
            });
        }
        Ok(Some(id.to_owned()))
    }

    /// Stores `id` as the owner identity of the home, durably, unless the home has one: the
    /// file is created once (SPEC §5) and never replaced, even by a writer racing this one.
    /// Returns the identity the home has now (`id`, or the one found).
    pub fn create_owner_id(&self, id: &str) -> Result<String> {
        let created = self
            .home_handle
            .create_new_atomic(
                OWNER_FILE,
                format!("{id}\n").as_bytes(),
                &self.write_options(),
            )
            .map_err(fs_err_ctx("writing the owner identity"))?;
        if created {
            return Ok(id.to_owned());
        }
        self.owner_id()?.ok_or_else(|| StoreError::UnsafePath {
            path: self.home.join(OWNER_FILE),
            why: "the owner identity file vanished right after it was found",
        })
    }

    /// Whether the home has the first release's `tasks/` directory.
    pub fn has_legacy_layout(&self) -> bool {
        self.home.join(LEGACY_TASKS_DIR).is_dir()
    }

    /// The first release's `tasks/` directory (opened following a link, as that release
    /// did), or `None` when there is none.
    fn legacy_dir(&self) -> Result<Option<Dir>> {
        self.home_handle
            .open_dir_following(LEGACY_TASKS_DIR)
            .map_err(fs_err_ctx("listing the task directories"))
    }

    /// The records of the first release's `tasks/<id>/` directories, read in place (nothing
    /// is changed): used to find the owner identity of such a home before migrating it.
    pub fn legacy_records(&self) -> Vec<TaskRecord> {
        let Ok(Some(legacy)) = self.legacy_dir() else {
            return Vec::new();
        };
        let Ok(names) = list_dirs(&legacy) else {
            return Vec::new();
        };
        names
            .into_iter()
            .filter_map(|name| {
                let dir = legacy.open_dir(&name).ok()??;
                read_record(&dir, Expect::TaskId(&name)).ok()?
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
        let mut report = Migration::default();
        let Some(legacy) = self.legacy_dir()? else {
            return Ok(report);
        };
        for name in list_dirs(&legacy)? {
            let dir = legacy.join(&name);
            let handle = legacy.open_dir(&name).ok().flatten();
            let record = handle.as_ref().and_then(|h| {
                if let Err(e) = h.remove_stale_temps(STATE_FILE) {
                    tracing::warn!(error = %error_chain(&e), "cannot remove stale temp files");
                }
                read_record(h, Expect::TaskId(&name)).ok().flatten()
            });
            let (Some(handle), Some((record, _))) = (&handle, record) else {
                if handle.as_ref().is_some_and(is_skeleton) {
                    legacy
                        .remove_tree(&name)
                        .map_err(fs_err_ctx("removing an empty legacy task directory"))?;
                } else {
                    tracing::warn!(dir = %dir.display(), "legacy task directory without a readable state file left where it is");
                    report.left += 1;
                }
                continue;
            };
            let target = self.paths(&record.container_name)?;
            if matches!(self.runners.stat(&record.container_name), Ok(Some(_))) {
                tracing::warn!(from = %dir.display(), to = %target.dir.display(), "cannot migrate a legacy task directory: the target exists; left where it is");
                report.left += 1;
                continue;
            }
            let bytes = format::encode(&record).map_err(|source| StoreError::Serialize {
                id: record.id.clone(),
                source,
            })?;
            handle
                .write_atomic(STATE_FILE, &bytes, &self.write_options())
                .map_err(fs_err_ctx(format!(
                    "rewriting {}",
                    dir.join(STATE_FILE).display()
                )))?;
            legacy
                .rename(&name, &self.runners, &record.container_name)
                .map_err(fs_err_ctx(format!(
                    "moving {} to {}",
                    dir.display(),
                    target.dir.display()
                )))?;
            self.runners
                .sync()
                .map_err(fs_err_ctx("syncing the runners directory"))?;
            legacy
                .sync()
                .map_err(fs_err_ctx("syncing the legacy tasks directory"))?;
            tracing::info!(task = %record.id, from = %dir.display(), to = %target.dir.display(), "task directory migrated");
            report.moved += 1;
        }
        if report.left == 0 {
            match self.home_handle.remove_dir(LEGACY_TASKS_DIR) {
                Ok(_) => {
                    if let Err(e) = self.home_handle.sync() {
                        tracing::warn!(error = %error_chain(&e), "cannot sync the shim home");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "cannot remove the legacy tasks directory")
                }
            }
        }
        Ok(report)
    }
}

/// Removes the state file of a submit that failed (logged when it cannot).
fn remove_failed_state_file(dir: &Dir, paths: &TaskPaths) {
    if let Err(rm) = dir.remove_file(STATE_FILE) {
        tracing::warn!(error = %error_chain(&rm), path = %paths.state_file.display(), "cannot remove the state file of a failed submit");
    }
}

/// Removes the spare task directories an earlier process left in `runners` (none of them
/// was published: a published one has a task's name). Errors are logged.
fn remove_spares(runners: &Dir) {
    let names = match runners.names() {
        Ok(names) => names,
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "cannot list the runners directory to remove spare directories");
            return;
        }
    };
    for name in names {
        if name.to_str().is_some_and(|n| n.starts_with(SPARE_PREFIX))
            && let Err(e) = runners.remove_tree(&name)
        {
            tracing::warn!(error = %error_chain(&e), "cannot remove a spare task directory");
        }
    }
}

/// The names of the directories in `dir` (never a symbolic link), sorted; hidden entries
/// (trash among them) and names that are not UTF-8 are skipped.
fn list_dirs(dir: &Dir) -> Result<Vec<String>> {
    let listing = dir
        .names()
        .map_err(fs_err_ctx("listing the task directories"))?;
    let mut dirs = Vec::new();
    for name in listing {
        let Ok(name) = name.into_string() else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        match dir.stat(&name) {
            Ok(Some(info)) if info.kind == FileKind::Directory => dirs.push(name),
            Ok(_) => tracing::debug!(path = %dir.join(&name).display(), "not a directory; ignored"),
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot stat an entry of a task directory root")
            }
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// Whether `dir` holds nothing but an empty `runner/` directory (or nothing at all).
fn is_skeleton(dir: &Dir) -> bool {
    let Ok(names) = dir.names() else {
        return false;
    };
    names.iter().all(|name| {
        name == RUNNER_DIR
            && matches!(dir.open_dir(RUNNER_DIR), Ok(Some(runner))
                if runner.names().is_ok_and(|inner| inner.is_empty()))
    })
}

/// Moves the state file in the task directory `handle` (at `dir`) aside as
/// `task.json.corrupt-<ms>`, durably; where it went (`None`: it could not be moved, logged).
fn set_aside(handle: &Dir, dir: &Path) -> Option<PathBuf> {
    let target = free_name(handle, CORRUPT_PREFIX);
    match handle.rename(STATE_FILE, handle, &target) {
        Ok(()) => {
            if let Err(e) = handle.sync() {
                tracing::warn!(error = %error_chain(&e), "cannot sync a task directory");
            }
            Some(dir.join(&target))
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %error_chain(&e), "cannot move an unusable state file aside");
            None
        }
    }
}

/// [`Store::scan`]'s entry for a state file that cannot be read now: left in place, read
/// again at the next start.
fn unreadable_now(name: String, dir: PathBuf, error: RecordError) -> ScanEntry {
    tracing::warn!(
        file = %dir.join(STATE_FILE).display(),
        error = %error_chain(&error),
        "cannot read a task state file now; left in place to be read at the next start, the task is restored from its container if any",
    );
    ScanEntry::Corrupt {
        name,
        dir,
        moved_to: None,
        error,
    }
}

/// Reads and decodes the state file in a task directory (a bounded read of a regular file,
/// never through a link); `None` when there is none.
fn read_record(dir: &Dir, expect: Expect<'_>) -> Result<Option<(TaskRecord, Origin)>, RecordError> {
    match dir.read_file(STATE_FILE, MAX_RECORD_BYTES) {
        Ok(Some((bytes, _))) => format::decode(&bytes, expect).map(Some),
        Ok(None) => Ok(None),
        Err(shim_fs::FsError::WrongType { .. }) => Err(RecordError::NotAFile),
        Err(shim_fs::FsError::TooLarge { .. }) => {
            let len = dir
                .stat(STATE_FILE)
                .ok()
                .flatten()
                .map_or(MAX_RECORD_BYTES + 1, |info| info.len);
            Err(RecordError::TooLarge(len))
        }
        Err(e) => Err(RecordError::Io(fs_io(e))),
    }
}
