//! A new directory holding one file, made durable at the price of one file fsync and one
//! fsync of its parent (which concurrent callers may share: [`crate::GroupSync`]).
//!
//! Making a new directory `d` with a file `f` durable takes three fsyncs when done on the
//! spot: `f` (its data), `d` (the entry `f`), and the parent (the entry `d`). A
//! [`PreparedDir`] moves the second ahead of time: the directory is made under a hidden name,
//! with its subdirectories and `f` created empty, and fsynced ([`Dir::prepare_dir`]). When
//! it is needed, [`PreparedDir::publish`] writes `f`, fsyncs it and renames the directory to
//! its name; the caller's fsync of the parent then makes it all durable. After a crash at any
//! point the directory is under its name with the whole file, or not under its name at all
//! (a prepared directory under its hidden name, which the owner sweeps).

use std::ffi::{OsStr, OsString};
use std::io::Write as _;
use std::os::fd::{AsFd as _, OwnedFd};

use rustix::fs::{Mode, OFlags, RenameFlags};
use rustix::io::Errno;

use crate::atomic::WriteOptions;
use crate::dir::{Dir, check_name};
use crate::error::{FsError, Result, Step};

/// A directory made ahead of its use under a hidden name in its parent: its subdirectories
/// and one empty file, all durable (the directory was fsynced after they were made; its own
/// entry in the parent need not be). [`PreparedDir::publish`] fills the file and gives the
/// directory its name; dropping it unused leaves it on disk for its owner to sweep
/// ([`PreparedDir::discard`] removes it).
#[derive(Debug)]
pub struct PreparedDir {
    /// Its hidden name in the parent.
    name: OsString,
    dir: Dir,
    file_name: OsString,
    file: std::fs::File,
}

impl Dir {
    /// Makes the directory `name` here (exactly `mode`; [`FsError`] with an `AlreadyExists`
    /// kind when the name is taken), in it the subdirectories `subdirs` (name, mode) and the
    /// empty regular file `file` (exactly `file_mode`), then fsyncs it. This directory is not
    /// fsynced: a prepared directory matters only once published. On error what was made is
    /// removed again.
    pub fn prepare_dir(
        &self,
        name: impl AsRef<OsStr>,
        mode: u32,
        subdirs: &[(&str, u32)],
        file: impl AsRef<OsStr>,
        file_mode: u32,
    ) -> Result<PreparedDir> {
        let name = check_name(self.path(), name.as_ref())?;
        let file_name = check_name(self.path(), file.as_ref())?;
        let (dir, created) = self.create_dir_unsynced(name, mode, None)?;
        if !created {
            return Err(FsError::io(
                Step::CreateDir,
                self.join(name),
                std::io::ErrorKind::AlreadyExists.into(),
            ));
        }
        let made = (|| {
            for (sub, sub_mode) in subdirs {
                dir.create_dir_unsynced(sub, *sub_mode, None)?;
            }
            let fd = dir.create_empty(file_name, file_mode)?;
            dir.sync()?;
            Ok(fd)
        })();
        match made {
            Ok(fd) => Ok(PreparedDir {
                name: name.to_owned(),
                dir,
                file_name: file_name.to_owned(),
                file: std::fs::File::from(fd),
            }),
            Err(e) => {
                if let Err(rm) = self.remove_tree(name) {
                    tracing::warn!(dir = %self.join(name).display(), error = %rm, "cannot remove a directory whose preparation failed");
                }
                Err(e)
            }
        }
    }

    /// Creates the empty regular file `name` (`O_CREAT|O_EXCL|O_NOFOLLOW`) with exactly
    /// `mode`, open for writing.
    fn create_empty(&self, name: &OsStr, mode: u32) -> Result<OwnedFd> {
        let path = self.join(name);
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = self
            .tap
            .around(
                || rustix::fs::openat(self, name, flags, Mode::from_raw_mode(mode as _)),
                |s, fd| s.create(self.as_fd(), name, fd.as_fd(), flags, mode),
            )
            .map_err(|e| FsError::sys(Step::Create, &path, e))?;
        // Whatever the umask.
        self.tap
            .around(
                || rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode as _)),
                |s, ()| s.set_mode(fd.as_fd(), mode),
            )
            .map_err(|e| FsError::sys(Step::SetMode, &path, e))?;
        Ok(fd)
    }
}

impl PreparedDir {
    /// Its hidden name in the parent.
    pub fn name(&self) -> &OsStr {
        &self.name
    }

    /// Writes `data` into the prepared file, fsyncs it, and renames the directory to `to` in
    /// `parent` (the directory it was prepared in), never replacing what `to` names (then
    /// [`FsError`] with an `AlreadyExists` kind). The new name is durable once `parent` is
    /// fsynced ([`Dir::sync`], [`crate::GroupSync::sync`]); the content already is. Returns
    /// the directory's handle. On error the prepared directory is removed and `to` is left
    /// as it was. `opts` brings the faults of tests (its mode and owner are the
    /// preparation's).
    pub fn publish(
        self,
        parent: &Dir,
        to: impl AsRef<OsStr>,
        data: &[u8],
        opts: &WriteOptions,
    ) -> Result<Dir> {
        let to = check_name(parent.path(), to.as_ref())?;
        let hooks = opts.hooks();
        let tap = parent.tap.clone();
        let path = self.dir.join(&self.file_name);
        let PreparedDir {
            name,
            dir,
            file_name: _,
            mut file,
        } = self;
        let published = (|| {
            hooks.inject_write(&mut file, data, &path)?;
            {
                let f = &file;
                tap.around(
                    || (&*f).write_all(data),
                    |s, ()| s.write(f.as_fd(), 0, data),
                )
                .map_err(|e| FsError::io(Step::Write, &path, e))?;
            }
            hooks.inject(Step::SyncFile, &path)?;
            if !tap.skips_file_fsync() {
                let f = &file;
                tap.around(|| f.sync_all(), |s, ()| s.fsync(f.as_fd()))
                    .map_err(|e| FsError::io(Step::SyncFile, &path, e))?;
            }
            hooks.inject(Step::Rename, &parent.join(to))?;
            rename_noreplace(parent, &name, to)
        })();
        drop(file);
        match published {
            Ok(()) => Ok(dir.renamed(parent.join(to))),
            Err(e) => {
                if !hooks.crashed()
                    && let Err(rm) = parent.remove_tree(&name)
                {
                    tracing::warn!(dir = %parent.join(&name).display(), error = %rm, "cannot remove a prepared directory whose publication failed");
                }
                Err(e)
            }
        }
    }

    /// Removes the prepared directory (from `parent`, the directory it was prepared in).
    pub fn discard(self, parent: &Dir) -> Result<()> {
        let name = self.name;
        drop(self.file);
        drop(self.dir);
        parent.remove_tree(&name).map(drop)
    }
}

/// `renameat2(RENAME_NOREPLACE)` of `from` to `to`, both in `dir`, recorded; where the file
/// system lacks it, a `renameat` after checking that `to` does not exist.
fn rename_noreplace(dir: &Dir, from: &OsStr, to: &OsStr) -> Result<()> {
    let target = dir.join(to);
    let renamed = dir.tap.around(
        || rustix::fs::renameat_with(dir, from, dir, to, RenameFlags::NOREPLACE),
        |s, ()| s.rename(dir.as_fd(), from, dir.as_fd(), to),
    );
    match renamed {
        Ok(()) => Ok(()),
        Err(Errno::INVAL | Errno::NOSYS) => {
            if dir.stat(to)?.is_some() {
                return Err(FsError::io(
                    Step::Rename,
                    target,
                    std::io::ErrorKind::AlreadyExists.into(),
                ));
            }
            dir.tap
                .around(
                    || rustix::fs::renameat(dir, from, dir, to),
                    |s, ()| s.rename(dir.as_fd(), from, dir.as_fd(), to),
                )
                .map_err(|e| FsError::sys(Step::Rename, target, e))
        }
        Err(e @ (Errno::EXIST | Errno::NOTEMPTY)) => Err(FsError::io(
            Step::Rename,
            target,
            std::io::Error::new(std::io::ErrorKind::AlreadyExists, e),
        )),
        Err(e) => Err(FsError::sys(Step::Rename, target, e)),
    }
}
