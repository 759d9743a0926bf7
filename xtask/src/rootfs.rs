//! The older distribution's root file system the release artifact is tested in
//! ([`shim_e2e::OLD_ROOTFS`], Debian [`shim_e2e::OLD_ROOTFS_SUITE`]): `debootstrap
//! --variant=minbase` from the Debian mirror, made once (a few minutes, ~150 MiB) and kept.
//! The test (`tests/tests/dist.rs`) enters it with `chroot` in a mount namespace of its own,
//! so it never mounts anything into the kept tree.

use std::path::{Path, PathBuf};

use anyhow::Result;
use shim_e2e::{OLD_ROOTFS_SUITE, old_rootfs};

use crate::{cmd, mounts};

/// The Debian mirror debootstrap fetches from.
const MIRROR: &str = "http://deb.debian.org/debian";
/// Written last into a finished root file system: its content names the suite.
const DONE_MARKER: &str = ".dstack-shim-dev-rootfs";

/// Whether the root file system is there and finished.
pub fn ready() -> bool {
    let marker = old_rootfs().join(DONE_MARKER);
    fs_err::read_to_string(marker).is_ok_and(|suite| suite.trim() == OLD_ROOTFS_SUITE)
}

/// Makes the root file system unless it is [`ready`]. Call under the dev-env lock.
pub fn ensure() -> Result<()> {
    let rootfs = old_rootfs();
    if ready() {
        println!("rootfs: {} has Debian {OLD_ROOTFS_SUITE}", rootfs.display());
        return Ok(());
    }
    let partial = with_suffix(&rootfs, ".partial");
    mounts::remove_tree(&partial)?;
    mounts::remove_tree(&rootfs)?;
    println!(
        "rootfs: making {} (debootstrap --variant=minbase {OLD_ROOTFS_SUITE}, a few minutes)",
        rootfs.display()
    );
    let result = cmd::run(
        cmd::cmd(cmd::find_program("debootstrap"))
            .args(["--variant=minbase", OLD_ROOTFS_SUITE])
            .arg(&partial)
            .arg(MIRROR),
    );
    // debootstrap mounts /proc and /sys in the target while it installs; a failed run may
    // leave them mounted.
    mounts::unmount_under(&partial)?;
    result?;
    fs_err::write(partial.join(DONE_MARKER), format!("{OLD_ROOTFS_SUITE}\n"))?;
    fs_err::rename(&partial, &rootfs)?;
    println!(
        "rootfs: made {} (Debian {OLD_ROOTFS_SUITE})",
        rootfs.display()
    );
    Ok(())
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}
