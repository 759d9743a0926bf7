//! Atomic replace: temp file beside the target (`O_CREAT|O_EXCL|O_NOFOLLOW`, mode set
//! explicitly), write, fsync, rename over the target, fsync of the directory.

use std::ffi::{OsStr, OsString};
use std::io::Write as _;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;

use crate::dir::{Dir, FileKind, Owner, check_name, set_owner};
use crate::error::{FsError, Result, Step};
use crate::tap::Tap;

/// Mode, owner (and, in tests, faults) of an atomic write.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    mode: u32,
    owner: Option<Owner>,
    preserve: bool,
    #[cfg(any(test, feature = "test-support"))]
    faults: Option<std::sync::Arc<crate::fault::Faults>>,
}

impl Default for WriteOptions {
    /// Mode 0600, the writer's owner.
    fn default() -> Self {
        Self::new(0o600)
    }
}

impl WriteOptions {
    /// The written file gets exactly `mode` (whatever the umask) and the writer's owner.
    pub fn new(mode: u32) -> Self {
        Self {
            mode: mode & 0o7777,
            owner: None,
            preserve: false,
            #[cfg(any(test, feature = "test-support"))]
            faults: None,
        }
    }

    /// The written file gets this owner (`None`: the writer's).
    pub fn owner(mut self, owner: impl Into<Option<Owner>>) -> Self {
        self.owner = owner.into();
        self
    }

    /// When the target exists as a regular file, the new file gets *its* mode and owner; the
    /// mode and owner given here apply only when the target is created.
    pub fn preserve_existing(mut self) -> Self {
        self.preserve = true;
        self
    }

    /// Injects the fault armed in `faults` (tests only).
    #[cfg(any(test, feature = "test-support"))]
    pub fn faults(mut self, faults: std::sync::Arc<crate::fault::Faults>) -> Self {
        self.faults = Some(faults);
        self
    }

    pub(crate) fn hooks(&self) -> Hooks<'_> {
        Hooks {
            #[cfg(any(test, feature = "test-support"))]
            faults: self.faults.as_deref(),
            _life: std::marker::PhantomData,
        }
    }
}

/// Fault injection points; a no-op unless built for tests.
#[derive(Clone, Copy)]
pub(crate) struct Hooks<'a> {
    #[cfg(any(test, feature = "test-support"))]
    faults: Option<&'a crate::fault::Faults>,
    _life: std::marker::PhantomData<&'a ()>,
}

impl Hooks<'_> {
    #[cfg(any(test, feature = "test-support"))]
    fn take(&self, step: Step) -> Option<crate::fault::FaultKind> {
        self.faults.and_then(|f| f.take(step))
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn inject(&self, step: Step, path: &Path) -> Result<()> {
        match self.take(step) {
            None => Ok(()),
            Some(kind) => Err(injected(step, kind, path)),
        }
    }

    /// The write step's fault: a crash writes half of `partial` first.
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn inject_write(
        &self,
        file: &mut std::fs::File,
        partial: &[u8],
        path: &Path,
    ) -> Result<()> {
        if let Some(faults) = self.faults {
            faults.wait_while_held();
        }
        if self.faults.is_some_and(crate::fault::Faults::is_full) {
            let full = std::io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error());
            return Err(FsError::io(Step::Write, path, full));
        }
        match self.take(Step::Write) {
            None => Ok(()),
            Some(kind) => {
                if kind == crate::fault::FaultKind::Crash {
                    file.write_all(&partial[..partial.len() / 2])
                        .map_err(|e| FsError::io(Step::Write, path, e))?;
                }
                Err(injected(Step::Write, kind, path))
            }
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn crashed(&self) -> bool {
        self.faults.is_some_and(crate::fault::Faults::crashed)
    }

    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    pub(crate) fn inject(&self, _step: Step, _path: &Path) -> Result<()> {
        Ok(())
    }

    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    pub(crate) fn inject_write(
        &self,
        _file: &mut std::fs::File,
        _partial: &[u8],
        _path: &Path,
    ) -> Result<()> {
        Ok(())
    }

    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    pub(crate) fn crashed(&self) -> bool {
        false
    }
}

#[cfg(any(test, feature = "test-support"))]
fn injected(step: Step, kind: crate::fault::FaultKind, path: &Path) -> FsError {
    FsError::io(
        step,
        path,
        std::io::Error::other(crate::fault::Injected { step, kind }),
    )
}

/// The temp file of an atomic write, handed to the writer callback of
/// [`Dir::write_atomic_with`].
#[derive(Debug)]
pub struct TempFile {
    file: std::fs::File,
    path: PathBuf,
    written: u64,
    tap: Tap,
}

impl TempFile {
    /// Appends `buf`; an error names the temp file and [`Step::Write`].
    pub fn write_all(&mut self, buf: &[u8]) -> Result<()> {
        let (file, offset) = (&self.file, self.written);
        self.tap
            .around(
                || (&*file).write_all(buf),
                |s, ()| s.write(file.as_fd(), offset, buf),
            )
            .map_err(|e| FsError::io(Step::Write, &self.path, e))?;
        self.written += buf.len() as u64;
        Ok(())
    }

    /// How many bytes [`TempFile::write_all`] wrote so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// The temp file's path (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// How the finished temp file takes the target's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publish {
    /// `renameat` over the target.
    Replace,
    /// `linkat`, which fails if the target exists (the first write wins).
    NoReplace,
}

/// Distinguishes this process's temp files from those of an earlier process with the same
/// pid (a shim restarted in a container is often pid 1 again).
fn process_token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{}-{nanos:x}", std::process::id())
    })
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// `.<name>.tmp-`: the prefix of every temp file written for target `name`.
fn temp_prefix(name: &OsStr) -> OsString {
    let mut p = OsString::from(".");
    p.push(name);
    p.push(".tmp-");
    p
}

/// Whether `file` is the name of a temp file of an atomic write of `target` (by any process).
pub fn is_temp_of(target: impl AsRef<OsStr>, file: impl AsRef<OsStr>) -> bool {
    file.as_ref()
        .as_bytes()
        .starts_with(temp_prefix(target.as_ref()).as_bytes())
}

impl Dir {
    /// Atomically replaces (or creates) the file `name` with `data`: a temp file beside it
    /// (`O_CREAT|O_EXCL|O_NOFOLLOW`, the mode and owner of `opts` set explicitly), write,
    /// fsync, `renameat` over `name`, fsync of the directory. After a crash at any point `name`
    /// holds the old or the new content. On error the old content is intact and the temp file
    /// removed, except when the final directory fsync failed: the new content is then in
    /// place but may not survive a power loss. A symbolic link at `name` is replaced, never
    /// followed.
    pub fn write_atomic(
        &self,
        name: impl AsRef<OsStr>,
        data: &[u8],
        opts: &WriteOptions,
    ) -> Result<()> {
        self.publish(name.as_ref(), opts, Publish::Replace, data, |f| {
            f.write_all(data)
        })
        .map(drop)
    }

    /// Like [`Dir::write_atomic`], the content coming from `write`, which streams it into the
    /// temp file (e.g. a download). If `write` fails, the temp file is removed, the target
    /// left untouched, and its error returned.
    pub fn write_atomic_with<E: From<FsError>>(
        &self,
        name: impl AsRef<OsStr>,
        opts: &WriteOptions,
        write: impl FnOnce(&mut TempFile) -> Result<(), E>,
    ) -> Result<(), E> {
        self.publish(name.as_ref(), opts, Publish::Replace, &[], write)
            .map(drop)
    }

    /// Creates the file `name` with `data` atomically and durably unless it exists: the same
    /// steps as [`Dir::write_atomic`] with `linkat` in place of the rename, so an existing file
    /// (even one appearing meanwhile) is never replaced. Returns whether it was created.
    pub fn create_new_atomic(
        &self,
        name: impl AsRef<OsStr>,
        data: &[u8],
        opts: &WriteOptions,
    ) -> Result<bool> {
        self.publish(name.as_ref(), opts, Publish::NoReplace, data, |f| {
            f.write_all(data)
        })
    }

    /// Removes the temp files of atomic writes of `name` left by *other* processes (a crash
    /// mid-write); returns how many. This process's own temp files are left alone (a write
    /// may be in flight).
    pub fn remove_stale_temps(&self, name: impl AsRef<OsStr>) -> Result<usize> {
        self.remove_temps_unchanged_for(name, None)
    }

    /// [`Dir::remove_stale_temps`] for a directory other programs may write `name` in at the
    /// same time (another shim on the same host, with another home, adding keys for the same
    /// user): only temp files unchanged for at least `min_age` are removed, so that no write
    /// in flight, whoever's, loses its temp file.
    pub fn remove_temps_older_than(
        &self,
        name: impl AsRef<OsStr>,
        min_age: std::time::Duration,
    ) -> Result<usize> {
        self.remove_temps_unchanged_for(name, Some(min_age))
    }

    fn remove_temps_unchanged_for(
        &self,
        name: impl AsRef<OsStr>,
        min_age: Option<std::time::Duration>,
    ) -> Result<usize> {
        let name = check_name(self.path(), name.as_ref())?;
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let mut own = temp_prefix(name);
        own.push(process_token());
        own.push(".");
        let mut removed = 0;
        for file in self.names()? {
            let stale = is_temp_of(name, &file) && !file.as_bytes().starts_with(own.as_bytes());
            let old_enough = || match min_age {
                None => Ok(true),
                Some(age) => Ok::<_, FsError>(self.stat(&file)?.is_some_and(|info| {
                    let age_s = i64::try_from(age.as_secs()).unwrap_or(i64::MAX);
                    now_s.saturating_sub(info.modified_unix_s) >= age_s
                })),
            };
            if stale && old_enough()? && self.remove_file(&file)? {
                tracing::info!(file = %self.join(&file).display(),
                    "removed the temp file of an interrupted write");
                removed += 1;
            }
        }
        Ok(removed)
    }

    fn publish<E: From<FsError>>(
        &self,
        name: &OsStr,
        opts: &WriteOptions,
        how: Publish,
        partial: &[u8],
        write: impl FnOnce(&mut TempFile) -> Result<(), E>,
    ) -> Result<bool, E> {
        let name = check_name(self.path(), name)?;
        let target = self.join(name);
        let hooks = opts.hooks();
        let (mode, owner) = match (opts.preserve, self.stat(name)?) {
            (true, Some(info)) if info.kind == FileKind::Regular => (info.mode, Some(info.owner())),
            _ => (opts.mode, opts.owner),
        };

        let tap = &self.tap;
        hooks.inject(Step::CreateTemp, &target)?;
        let (tmp_name, fd) = self.create_temp(name, mode)?;
        let tmp_path = self.join(&tmp_name);
        let mut guard = TempGuard {
            dir: self,
            name: Some(tmp_name),
            hooks,
        };
        if let Some(o) = owner {
            set_owner(&fd, o, &tmp_path)?;
        }
        // After the chown (which may clear set-id bits), and whatever the umask.
        tap.around(
            || rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode as _)),
            |s, ()| s.set_mode(fd.as_fd(), mode),
        )
        .map_err(|e| FsError::sys(Step::SetMode, &tmp_path, e))?;
        let mut file = TempFile {
            file: std::fs::File::from(fd),
            path: tmp_path.clone(),
            written: 0,
            tap: tap.clone(),
        };
        hooks.inject_write(&mut file.file, partial, &tmp_path)?;
        write(&mut file)?;
        hooks.inject(Step::SyncFile, &tmp_path)?;
        if !tap.skips_file_fsync() {
            let f = &file.file;
            tap.around(|| f.sync_all(), |s, ()| s.fsync(f.as_fd()))
                .map_err(|e| FsError::io(Step::SyncFile, &tmp_path, e))?;
        }
        drop(file);
        let tmp_name = guard.name.as_deref().unwrap_or_default();
        let created = match how {
            Publish::Replace => {
                hooks.inject(Step::Rename, &target)?;
                tap.around(
                    || rustix::fs::renameat(self, tmp_name, self, name),
                    |s, ()| s.rename(self.as_fd(), tmp_name, self.as_fd(), name),
                )
                .map_err(|e| FsError::sys(Step::Rename, &target, e))?;
                guard.name = None;
                true
            }
            Publish::NoReplace => {
                hooks.inject(Step::Link, &target)?;
                let linked = tap.around(
                    || rustix::fs::linkat(self, tmp_name, self, name, AtFlags::empty()),
                    |s, ()| s.link(self.as_fd(), tmp_name, self.as_fd(), name),
                );
                match linked {
                    Ok(()) => true,
                    Err(Errno::EXIST) => false,
                    Err(e) => return Err(FsError::sys(Step::Link, &target, e).into()),
                }
                // The guard removes the temp name either way.
            }
        };
        drop(guard);
        if created && !tap.skips_publish_dir_fsync() {
            hooks.inject(Step::SyncDir, self.path())?;
            self.sync()?;
        }
        Ok(created)
    }

    /// Creates a fresh temp file for `name` with `mode` (narrowed by the umask until fchmod).
    fn create_temp(&self, name: &OsStr, mode: u32) -> Result<(OsString, OwnedFd)> {
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut last = Errno::EXIST;
        // A name taken (planted, or left by an earlier process with the same token) is skipped.
        for _ in 0..64 {
            let mut tmp = temp_prefix(name);
            tmp.push(format!(
                "{}.{}",
                process_token(),
                TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            let opened = self.tap.around(
                || rustix::fs::openat(self, &tmp, flags, Mode::from_raw_mode(mode as _)),
                |s, fd| s.create(self.as_fd(), &tmp, fd.as_fd(), flags, mode),
            );
            match opened {
                Ok(fd) => return Ok((tmp, fd)),
                Err(Errno::EXIST) => last = Errno::EXIST,
                Err(e) => {
                    last = e;
                    break;
                }
            }
        }
        Err(FsError::sys(Step::CreateTemp, self.join(name), last))
    }
}

/// Removes the temp file when a write stops before it was renamed (unless a test crashed it).
struct TempGuard<'a> {
    dir: &'a Dir,
    name: Option<OsString>,
    hooks: Hooks<'a>,
}

impl Drop for TempGuard<'_> {
    fn drop(&mut self) {
        let Some(name) = self.name.take() else {
            return;
        };
        if self.hooks.crashed() {
            return;
        }
        if let Err(e) = self.dir.unlink(&name)
            && e != Errno::NOENT
        {
            tracing::warn!(file = %self.dir.join(&name).display(), error = %e,
                    "cannot remove the temp file of a failed write");
        }
    }
}

/// Splits `path` into its directory (opened following links: a trusted path) and file name.
fn split(path: &Path) -> Result<(Dir, &OsStr)> {
    let name = path.file_name().ok_or_else(|| FsError::InvalidName {
        dir: path.to_owned(),
        name: path.to_string_lossy().into_owned(),
    })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Ok((Dir::open(parent)?, name))
}

/// [`Dir::write_atomic`] on `path`'s directory.
pub fn write_atomic(path: impl AsRef<Path>, data: &[u8], opts: &WriteOptions) -> Result<()> {
    let (dir, name) = split(path.as_ref())?;
    dir.write_atomic(name, data, opts)
}

/// [`Dir::write_atomic_with`] on `path`'s directory.
pub fn write_atomic_with<E: From<FsError>>(
    path: impl AsRef<Path>,
    opts: &WriteOptions,
    write: impl FnOnce(&mut TempFile) -> Result<(), E>,
) -> Result<(), E> {
    let (dir, name) = split(path.as_ref())?;
    dir.write_atomic_with(name, opts, write)
}

/// [`Dir::create_new_atomic`] on `path`'s directory.
pub fn create_new_atomic(path: impl AsRef<Path>, data: &[u8], opts: &WriteOptions) -> Result<bool> {
    let (dir, name) = split(path.as_ref())?;
    dir.create_new_atomic(name, data, opts)
}

/// [`Dir::read_file`] on `path`'s directory: a regular file of at most `max` bytes, never
/// through a symbolic link in its last component; `None` when it does not exist.
pub fn read_file(
    path: impl AsRef<Path>,
    max: u64,
) -> Result<Option<(Vec<u8>, crate::dir::FileInfo)>> {
    let (dir, name) = split(path.as_ref())?;
    dir.read_file(name, max)
}
