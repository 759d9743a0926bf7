//! The mount system calls and the mount table, behind [`Mounter`] (the real one:
//! [`SystemMounter`]; a recording fake is `fake::FakeMounter`).

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

use super::parse::{is_mount_point_in, mount_at};
use crate::error::{ResourcesError, Result, io_err};

/// The mount system calls and the mount table, behind a trait so that the volume logic can be
/// tested with a recording fake (youki's `Syscall` pattern). Blocking: [`super::BlockVolumes`] calls
/// every method from `tokio::task::spawn_blocking`.
pub trait Mounter: Send + Sync {
    /// Mounts the file system `fstype` on `device` at `target` (which exists).
    fn mount(&self, device: &Path, target: &Path, fstype: &str) -> Result<()>;

    /// Unmounts `target`; a target that is not (or no longer) mounted, or gone, is `Ok`.
    fn unmount(&self, target: &Path) -> Result<()>;

    /// Whether `target` is a mount point.
    fn is_mounted(&self, target: &Path) -> Result<bool>;

    /// Whether the file system mounted at `target` is the one on `device`: `None` when that
    /// cannot be told (nothing mounted there, a device that cannot be looked at, a source that
    /// is no path, or a mounter that does not know).
    fn mounted_from(&self, target: &Path, device: &Path) -> Result<Option<bool>> {
        let _ = (target, device);
        Ok(None)
    }
}

/// The real [`Mounter`]: mount(2), umount(2) and a mountinfo table.
#[derive(Debug, Clone)]
pub struct SystemMounter {
    mountinfo: PathBuf,
}

impl SystemMounter {
    /// Mount points are read from `mountinfo` (normally `/proc/self/mountinfo`).
    pub fn new(mountinfo: impl Into<PathBuf>) -> Self {
        Self {
            mountinfo: mountinfo.into(),
        }
    }
}

impl Mounter for SystemMounter {
    fn mount(&self, device: &Path, target: &Path, fstype: &str) -> Result<()> {
        nix::mount::mount(
            Some(device),
            target,
            Some(fstype),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|source| ResourcesError::Mount {
            device: device.to_owned(),
            target: target.to_owned(),
            source,
        })
    }

    fn unmount(&self, target: &Path) -> Result<()> {
        match nix::mount::umount(target) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => Ok(()),
            Err(source) => Err(ResourcesError::Unmount {
                target: target.to_owned(),
                source,
            }),
        }
    }

    fn mounted_from(&self, target: &Path, device: &Path) -> Result<Option<bool>> {
        let table =
            fs_err::read_to_string(&self.mountinfo).map_err(io_err("read", &self.mountinfo))?;
        let resolved = fs_err::canonicalize(target).ok();
        let mounted =
            mount_at(&table, target).or_else(|| resolved.and_then(|r| mount_at(&table, &r)));
        let Some((number, source)) = mounted else {
            return Ok(None);
        };
        let Ok(meta) = fs_err::metadata(device) else {
            return Ok(None);
        };
        if !meta.file_type().is_block_device() {
            return Ok(None);
        }
        // By number (a partition, a loop device: the file system's device is the block
        // device), else by the source the table names (a file system whose device number is
        // its own, as btrfs's).
        if device_number(meta.rdev()) == number {
            return Ok(Some(true));
        }
        // A source that is no path (`tmpfs`, `host:/export`, a FUSE name) is never the
        // volume's: the shim mounts a device by its path.
        if !source.is_absolute() {
            return Ok(Some(false));
        }
        let (Ok(source), Ok(device)) =
            (fs_err::canonicalize(&source), fs_err::canonicalize(device))
        else {
            return Ok(None);
        };
        Ok(Some(source == device))
    }

    fn is_mounted(&self, target: &Path) -> Result<bool> {
        let table =
            fs_err::read_to_string(&self.mountinfo).map_err(io_err("read", &self.mountinfo))?;
        // The kernel lists a mount point by its resolved path: a volumes root through a
        // symbolic link (`/mnt` → `var/mnt`) would otherwise never be seen mounted, so
        // releases unmounted nothing and prepares mounted again on top.
        let resolved = fs_err::canonicalize(target).ok();
        Ok(is_mount_point_in(&table, target)
            || resolved.is_some_and(|r| is_mount_point_in(&table, &r)))
    }
}

/// Linux's `major:minor` of a device number (glibc's `gnu_dev_major` / `gnu_dev_minor`).
fn device_number(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}
