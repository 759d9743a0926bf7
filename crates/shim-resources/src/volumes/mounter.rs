//! The mount system calls and the mount table, behind [`Mounter`] (the real one:
//! [`SystemMounter`]; a recording fake is `fake::FakeMounter`).

use std::path::{Path, PathBuf};

use super::parse::is_mount_point_in;
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
