//! Directory handles: every operation is relative to an open directory (`openat`,
//! `renameat`, `fstatat`, `unlinkat`), so replacing a directory on the way by a symbolic link
//! after it was opened cannot redirect anything.

use std::ffi::{OsStr, OsString};
use std::io::Read as _;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{FsError, Result, Step};
use crate::tap::Tap;

/// What kind of file a path is (never following a symbolic link).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileKind {
    /// A regular file.
    Regular,
    /// A directory.
    Directory,
    /// A symbolic link.
    Symlink,
    /// A named pipe.
    Fifo,
    /// A Unix socket.
    Socket,
    /// A character device.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// Anything else.
    Unknown,
}

impl FileKind {
    fn from_mode(st_mode: u32) -> Self {
        match FileType::from_raw_mode(st_mode as _) {
            FileType::RegularFile => Self::Regular,
            FileType::Directory => Self::Directory,
            FileType::Symlink => Self::Symlink,
            FileType::Fifo => Self::Fifo,
            FileType::Socket => Self::Socket,
            FileType::CharacterDevice => Self::CharDevice,
            FileType::BlockDevice => Self::BlockDevice,
            _ => Self::Unknown,
        }
    }

    /// `"a regular file"`, `"a symbolic link"`, … (for messages).
    pub fn describe(self) -> &'static str {
        match self {
            Self::Regular => "a regular file",
            Self::Directory => "a directory",
            Self::Symlink => "a symbolic link",
            Self::Fifo => "a named pipe",
            Self::Socket => "a socket",
            Self::CharDevice => "a character device",
            Self::BlockDevice => "a block device",
            Self::Unknown => "of an unknown type",
        }
    }
}

/// A file's type, permission bits, owner and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileInfo {
    /// Its type.
    pub kind: FileKind,
    /// Its permission bits (`mode & 0o7777`).
    pub mode: u32,
    /// Its owner.
    pub uid: u32,
    /// Its group.
    pub gid: u32,
    /// Its size in bytes.
    pub len: u64,
    /// When its content last changed, in seconds since the Unix epoch.
    pub modified_unix_s: i64,
}

impl FileInfo {
    pub(crate) fn from_stat(st: &rustix::fs::Stat) -> Self {
        #[allow(
            clippy::unnecessary_cast,
            reason = "st_mode's type differs between platforms"
        )]
        let raw_mode = st.st_mode as u32;
        Self {
            kind: FileKind::from_mode(raw_mode),
            mode: raw_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            len: u64::try_from(st.st_size).unwrap_or(0),
            #[allow(
                clippy::unnecessary_cast,
                reason = "st_mtime's type differs between platforms"
            )]
            modified_unix_s: st.st_mtime as i64,
        }
    }

    /// The owner as an [`Owner`].
    pub fn owner(&self) -> Owner {
        Owner {
            uid: self.uid,
            gid: self.gid,
        }
    }
}

/// A file owner (user and group ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    /// The user id.
    pub uid: u32,
    /// The group id.
    pub gid: u32,
}

impl Owner {
    /// `uid:gid`.
    pub fn new(uid: u32, gid: u32) -> Self {
        Self { uid, gid }
    }
}

/// An open directory. Every method works relative to it: a name is one path component, a
/// symbolic link in its place is never followed, and swapping the directory's path for a link
/// after it was opened changes nothing (the handle keeps pointing at the directory opened).
///
/// The path is kept for messages only; it is never used to reach a file.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
    /// The crash recorder this handle (and every handle opened from it) reports to, in tests.
    pub(crate) tap: Tap,
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC
}

/// Checks that `name` is one path component and not `.` or `..`.
/// How many directories [`Dir::remove_tree`] keeps open below the one it empties.
pub const REMOVE_DEPTH: usize = 64;

pub(crate) fn check_name<'a>(dir: &Path, name: &'a OsStr) -> Result<&'a OsStr> {
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') || b.contains(&0) {
        return Err(FsError::InvalidName {
            dir: dir.to_owned(),
            name: name.to_string_lossy().into_owned(),
        });
    }
    Ok(name)
}

impl Dir {
    /// Opens the directory at `path`, following symbolic links on the way (for a trusted path:
    /// the shim's home, a home from the passwd database).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let fd = rustix::fs::openat(rustix::fs::CWD, path, dir_flags(), Mode::empty())
            .map_err(|e| FsError::sys(Step::OpenDir, path, e))?;
        Ok(Self {
            fd,
            path: path.to_owned(),
            tap: Tap::default(),
        })
    }

    /// Opens the directory at `path`, refusing ([`FsError::WrongType`]) when its last component
    /// is a symbolic link or not a directory.
    pub fn open_nofollow(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        match rustix::fs::openat(
            rustix::fs::CWD,
            path,
            dir_flags() | OFlags::NOFOLLOW,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(Self {
                fd,
                path: path.to_owned(),
                tap: Tap::default(),
            }),
            Err(e) => Err(classify_dir_error(rustix::fs::CWD, path, path, e)),
        }
    }

    /// This handle, recording its durable operations (and those of every handle opened from
    /// it) into `recorder` (tests: see [`crate::crash`]).
    #[cfg(any(test, feature = "test-support"))]
    pub fn with_recorder(mut self, recorder: std::sync::Arc<crate::crash::Recorder>) -> Self {
        self.tap = Tap::new(recorder);
        self
    }

    /// The same handle, known by `path` from now on (after the directory was renamed).
    pub(crate) fn renamed(self, path: PathBuf) -> Self {
        Self { path, ..self }
    }

    /// The path it was opened at (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path/name` (for messages).
    pub fn join(&self, name: impl AsRef<OsStr>) -> PathBuf {
        self.path.join(name.as_ref())
    }

    /// Opens the subdirectory `name` without following a symbolic link: `None` when it does
    /// not exist, [`FsError::WrongType`] when it is a link or not a directory.
    pub fn open_dir(&self, name: impl AsRef<OsStr>) -> Result<Option<Dir>> {
        let name = check_name(&self.path, name.as_ref())?;
        let path = self.join(name);
        match rustix::fs::openat(
            &self.fd,
            name,
            dir_flags() | OFlags::NOFOLLOW,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(Some(Self {
                fd,
                path,
                tap: self.tap.clone(),
            })),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(classify_dir_error(&self.fd, name, &path, e)),
        }
    }

    /// Opens the subdirectory `name`, following it if it is a symbolic link (for a trusted
    /// directory, like [`Dir::open`], but relative to this handle): `None` when it does not
    /// exist.
    pub fn open_dir_following(&self, name: impl AsRef<OsStr>) -> Result<Option<Dir>> {
        let name = check_name(&self.path, name.as_ref())?;
        let path = self.join(name);
        match rustix::fs::openat(&self.fd, name, dir_flags(), Mode::empty()) {
            Ok(fd) => Ok(Some(Self {
                fd,
                path,
                tap: self.tap.clone(),
            })),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(FsError::sys(Step::OpenDir, path, e)),
        }
    }

    /// Opens the subdirectory `name` (never through a link), creating it first when missing
    /// with exactly `mode` (whatever the umask) and, when given, `owner`; the creation is made
    /// durable (the parent is fsynced). An existing directory is left as it is. Returns the
    /// handle and whether it was created.
    pub fn create_dir(
        &self,
        name: impl AsRef<OsStr>,
        mode: u32,
        owner: Option<Owner>,
    ) -> Result<(Dir, bool)> {
        self.make_dir(name.as_ref(), mode, owner, true)
    }

    /// [`Dir::create_dir`] without the fsync of this directory: the creation becomes durable
    /// with this directory's next fsync ([`Dir::sync`], or a [`Dir::write_atomic`] into it),
    /// which the caller makes before it relies on the new directory surviving a crash. Saves
    /// one fsync when a file is written here right after.
    pub fn create_dir_unsynced(
        &self,
        name: impl AsRef<OsStr>,
        mode: u32,
        owner: Option<Owner>,
    ) -> Result<(Dir, bool)> {
        self.make_dir(name.as_ref(), mode, owner, false)
    }

    fn make_dir(
        &self,
        name: &OsStr,
        mode: u32,
        owner: Option<Owner>,
        sync: bool,
    ) -> Result<(Dir, bool)> {
        let name = check_name(&self.path, name)?;
        let path = self.join(name);
        // The mkdir goes first (a new directory is the common case: no lookup before it);
        // when it fails, an existing directory is opened. Two rounds: a directory removed
        // between the failed mkdir and the open is retried once.
        for _ in 0..2 {
            let made = self.tap.around(
                || rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode as _)),
                |s, ()| s.mkdir(self.fd.as_fd(), name, mode),
            );
            if let Err(e) = made {
                // Whatever the mkdir said (it exists; or a read-only file system, a
                // permission the shim lacks), a directory already there is used as it is.
                match self.open_dir(name)? {
                    Some(d) => return Ok((d, false)),
                    None if e == Errno::EXIST => continue,
                    None => return Err(FsError::sys(Step::CreateDir, &path, e)),
                }
            }
            let Some(d) = self.open_dir(name)? else {
                continue;
            };
            if let Some(o) = owner {
                set_owner(&d.fd, o, &path)?;
            }
            d.chmod(mode)
                .map_err(|e| FsError::sys(Step::SetMode, &path, e))?;
            if sync {
                self.sync()?;
            }
            return Ok((d, true));
        }
        Err(FsError::io(
            Step::CreateDir,
            path,
            std::io::Error::other("the directory kept disappearing"),
        ))
    }

    /// The type, mode, owner and size of `name`, not following a symbolic link; `None` when
    /// it does not exist.
    pub fn stat(&self, name: impl AsRef<OsStr>) -> Result<Option<FileInfo>> {
        let name = check_name(&self.path, name.as_ref())?;
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(FileInfo::from_stat(&st))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(FsError::sys(Step::Stat, self.join(name), e)),
        }
    }

    /// The directory's own type, mode and owner.
    pub fn info(&self) -> Result<FileInfo> {
        rustix::fs::fstat(&self.fd)
            .map(|st| FileInfo::from_stat(&st))
            .map_err(|e| FsError::sys(Step::Stat, &self.path, e))
    }

    /// Sets the directory's own mode to exactly `mode` (`fchmod` on the handle, so a link
    /// swapped in at its path changes nothing).
    pub fn set_mode(&self, mode: u32) -> Result<()> {
        self.chmod(mode & 0o7777)
            .map_err(|e| FsError::sys(Step::SetMode, &self.path, e))
    }

    fn chmod(&self, mode: u32) -> rustix::io::Result<()> {
        self.tap.around(
            || rustix::fs::fchmod(&self.fd, Mode::from_raw_mode(mode as _)),
            |s, ()| s.set_mode(self.fd.as_fd(), mode),
        )
    }

    /// Reads the regular file `name` whole, at most `max` bytes: `None` when it does not
    /// exist; [`FsError::WrongType`] for a symbolic link (never followed), a FIFO, a device or a
    /// directory; [`FsError::TooLarge`] beyond `max`. The info is that of the file read.
    pub fn read_file(
        &self,
        name: impl AsRef<OsStr>,
        max: u64,
    ) -> Result<Option<(Vec<u8>, FileInfo)>> {
        let name = check_name(&self.path, name.as_ref())?;
        let path = self.join(name);
        // O_NONBLOCK: opening a FIFO planted under the name must not block.
        let flags =
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(e @ Errno::LOOP) => {
                return Err(match self.stat(name) {
                    Ok(Some(info)) if info.kind != FileKind::Regular => FsError::WrongType {
                        step: Step::Open,
                        path,
                        found: info.kind.describe(),
                        expected: "a regular file",
                    },
                    _ => FsError::sys(Step::Open, path, e),
                });
            }
            Err(e) => return Err(FsError::sys(Step::Open, path, e)),
        };
        let info = rustix::fs::fstat(&fd)
            .map(|st| FileInfo::from_stat(&st))
            .map_err(|e| FsError::sys(Step::Stat, &path, e))?;
        if info.kind != FileKind::Regular {
            return Err(FsError::WrongType {
                step: Step::Open,
                path,
                found: info.kind.describe(),
                expected: "a regular file",
            });
        }
        if info.len > max {
            return Err(FsError::TooLarge { path, max });
        }
        let mut data = Vec::with_capacity(usize::try_from(info.len).unwrap_or(0));
        std::fs::File::from(fd)
            .take(max.saturating_add(1))
            .read_to_end(&mut data)
            .map_err(|e| FsError::io(Step::Read, &path, e))?;
        if data.len() as u64 > max {
            return Err(FsError::TooLarge { path, max });
        }
        Ok(Some((data, info)))
    }

    /// Removes the file (or symbolic link) `name`; `false` when it did not exist.
    pub fn remove_file(&self, name: impl AsRef<OsStr>) -> Result<bool> {
        let name = check_name(&self.path, name.as_ref())?;
        match self.unlink(name) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(FsError::sys(Step::Remove, self.join(name), e)),
        }
    }

    /// `unlinkat(name)`, recorded.
    pub(crate) fn unlink(&self, name: &OsStr) -> rustix::io::Result<()> {
        self.tap.around(
            || rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()),
            |s, ()| s.unlink(self.fd.as_fd(), name),
        )
    }

    /// Removes the empty directory `name` (never through a link); `false` when it did not
    /// exist. Durable with this directory's next fsync.
    pub fn remove_dir(&self, name: impl AsRef<OsStr>) -> Result<bool> {
        let name = check_name(&self.path, name.as_ref())?;
        match self.rmdir(name) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(FsError::sys(Step::Remove, self.join(name), e)),
        }
    }

    fn rmdir(&self, name: &OsStr) -> rustix::io::Result<()> {
        self.tap.around(
            || rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR),
            |s, ()| s.rmdir(self.fd.as_fd(), name),
        )
    }

    /// Removes `name` whatever it is: a directory with everything in it (each subdirectory
    /// opened relative to its parent, never through a link; a tree of any depth, with a bounded
    /// stack and at most [`REMOVE_DEPTH`] directories open), or a file or link. `false` when
    /// it did not exist. Nothing is fsynced: the removal is durable with this directory's
    /// next fsync.
    pub fn remove_tree(&self, name: impl AsRef<OsStr>) -> Result<bool> {
        let name = check_name(&self.path, name.as_ref())?;
        let Some(info) = self.stat(name)? else {
            return Ok(false);
        };
        if info.kind != FileKind::Directory {
            return self.remove_file(name);
        }
        if let Some(sub) = self.open_dir(name)? {
            sub.empty_out()?;
        }
        self.remove_dir(name)
    }

    /// Removes everything in this directory, depth first, with at most [`REMOVE_DEPTH`]
    /// directories open below it: a subdirectory found deeper is moved up into this one under
    /// a fresh name, and this directory is listed again until it is empty. A tree of any depth
    /// (a container nests its writable directory as deep as it likes) takes neither more stack
    /// nor more open files.
    fn empty_out(&self) -> Result<()> {
        let mut moved = 0;
        loop {
            let names = self.names()?;
            if names.is_empty() {
                return Ok(());
            }
            for name in names {
                self.remove_below(name, &mut moved)?;
            }
        }
    }

    /// Removes `name` and everything below it, for [`Dir::empty_out`] (this directory is the
    /// top of the removal); `moved` numbers the subdirectories moved up into it.
    fn remove_below(&self, name: OsString, moved: &mut u64) -> Result<()> {
        /// A directory being emptied: its name in its parent, and the names left in it.
        struct Level {
            name: OsString,
            dir: Dir,
            left: Vec<OsString>,
        }
        let mut levels: Vec<Level> = Vec::new();
        let mut next = Some(name);
        loop {
            let parent = levels.last().map_or(self, |l| &l.dir);
            match next.take() {
                Some(child) => match parent.stat(&child)? {
                    None => {}
                    Some(info) if info.kind != FileKind::Directory => {
                        parent.remove_file(&child)?;
                    }
                    Some(_) if levels.len() >= REMOVE_DEPTH => {
                        let to = self.unused_name(moved)?;
                        parent.rename(&child, self, &to)?;
                    }
                    Some(_) => {
                        if let Some(dir) = parent.open_dir(&child)? {
                            let left = dir.names()?;
                            levels.push(Level {
                                name: child,
                                dir,
                                left,
                            });
                        }
                    }
                },
                None => {
                    let Some(level) = levels.last_mut() else {
                        return Ok(());
                    };
                    next = level.left.pop();
                    if next.is_none() {
                        // Emptied: removed from its parent.
                        if let Some(done) = levels.pop() {
                            let parent = levels.last().map_or(self, |l| &l.dir);
                            parent.remove_dir(&done.name)?;
                        }
                    }
                }
            }
        }
    }

    /// A name in this directory that nothing has, `.deep-<n>` from `*n` on.
    fn unused_name(&self, n: &mut u64) -> Result<OsString> {
        loop {
            let name = OsString::from(format!(".deep-{n}"));
            *n += 1;
            if self.stat(&name)?.is_none() {
                return Ok(name);
            }
        }
    }

    /// Renames `from` (in this directory) to `to` in `to_dir` (`renameat`; this directory or
    /// another handle), replacing what `to` named as `rename(2)` does. Neither name is
    /// followed if it is a link. Durable once both directories have been fsynced.
    pub fn rename(
        &self,
        from: impl AsRef<OsStr>,
        to_dir: &Dir,
        to: impl AsRef<OsStr>,
    ) -> Result<()> {
        let from = check_name(&self.path, from.as_ref())?;
        let to = check_name(&to_dir.path, to.as_ref())?;
        self.tap
            .around(
                || rustix::fs::renameat(&self.fd, from, &to_dir.fd, to),
                |s, ()| s.rename(self.fd.as_fd(), from, to_dir.fd.as_fd(), to),
            )
            .map_err(|e| FsError::sys(Step::Rename, to_dir.join(to), e))
    }

    /// The names in the directory (without `.` and `..`).
    pub fn names(&self) -> Result<Vec<OsString>> {
        let listing = rustix::fs::Dir::read_from(&self.fd)
            .map_err(|e| FsError::sys(Step::List, &self.path, e))?;
        let mut names = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| FsError::sys(Step::List, &self.path, e))?;
            let n = entry.file_name().to_bytes();
            if n != b"." && n != b".." {
                names.push(OsStr::from_bytes(n).to_owned());
            }
        }
        Ok(names)
    }

    /// fsyncs the directory: makes creations, renames and removals in it durable.
    pub fn sync(&self) -> Result<()> {
        if self.tap.skips_dir_fsync() {
            return Ok(());
        }
        self.tap
            .around(
                || rustix::fs::fsync(&self.fd),
                |s, ()| s.fsync_dir(self.fd.as_fd()),
            )
            .map_err(|e| FsError::sys(Step::SyncDir, &self.path, e))
    }
}

/// Sets `owner` on an open file unless it already has it.
pub(crate) fn set_owner(fd: &OwnedFd, owner: Owner, path: &Path) -> Result<()> {
    let st = rustix::fs::fstat(fd).map_err(|e| FsError::sys(Step::Stat, path, e))?;
    if (st.st_uid, st.st_gid) == (owner.uid, owner.gid) {
        return Ok(());
    }
    rustix::fs::fchown(
        fd,
        Some(rustix::fs::Uid::from_raw_unchecked(owner.uid)),
        Some(rustix::fs::Gid::from_raw_unchecked(owner.gid)),
    )
    .map_err(|e| FsError::sys(Step::SetOwner, path, e))
}

/// A failed `open(O_DIRECTORY|O_NOFOLLOW)`: a link or a non-directory is [`FsError::WrongType`].
fn classify_dir_error<Fd: AsFd, P: rustix::path::Arg>(
    at: Fd,
    name: P,
    path: &Path,
    e: Errno,
) -> FsError {
    if matches!(e, Errno::LOOP | Errno::NOTDIR)
        && let Ok(st) = rustix::fs::statat(at, name, AtFlags::SYMLINK_NOFOLLOW)
    {
        let kind = FileInfo::from_stat(&st).kind;
        if kind != FileKind::Directory {
            return FsError::WrongType {
                step: Step::OpenDir,
                path: path.to_owned(),
                found: kind.describe(),
                expected: "a directory",
            };
        }
    }
    FsError::sys(Step::OpenDir, path, e)
}
