//! The older distribution's root file system the release artifact is tested in
//! ([`shim_e2e::OLD_ROOTFS`], Debian [`shim_e2e::OLD_ROOTFS_SUITE`]): `debootstrap
//! --variant=minbase` from the Debian mirror, made once (a few minutes, ~150 MiB) and kept.
//! The test (`tests/tests/dist.rs`) enters it with `chroot` in a mount namespace of its own,
//! so it never mounts anything into the kept tree.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use shim_e2e::{OLD_ROOTFS_SUITE, old_rootfs};

use crate::cmd;

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
    remove_tree(&partial)?;
    remove_tree(&rootfs)?;
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
    unmount_under(&partial)?;
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

/// Removes `tree` if it exists, after unmounting whatever is mounted inside it (never deletes
/// through a mount point into the host's `/proc`, `/sys` or `/dev`).
fn remove_tree(tree: &Path) -> Result<()> {
    if !tree.exists() {
        return Ok(());
    }
    unmount_under(tree)?;
    println!("rootfs: removing {}", tree.display());
    fs_err::remove_dir_all(tree)?;
    Ok(())
}

/// Unmounts (lazily, deepest first) every mount point at or below `tree`.
fn unmount_under(tree: &Path) -> Result<()> {
    let mountinfo = fs_err::read_to_string("/proc/self/mountinfo")?;
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(unescape_mountinfo(point)))
        .filter(|point| point.starts_with(tree))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        println!("rootfs: unmounting {}", point.display());
        cmd::run(cmd::cmd("umount").arg("--lazy").arg(&point))?;
    }
    if fs_err::read_to_string("/proc/self/mountinfo")?
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .any(|point| Path::new(&unescape_mountinfo(point)).starts_with(tree))
    {
        bail!("something is still mounted under {}", tree.display());
    }
    Ok(())
}

/// Mount points in `/proc/self/mountinfo` escape space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|digits| digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        if bytes[i] == b'\\'
            && let Some(digits) = octal
        {
            let code = digits
                .iter()
                .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            out.push(u8::try_from(code).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b"), "/tmp/a b");
        assert_eq!(unescape_mountinfo("/proc"), "/proc");
        assert_eq!(unescape_mountinfo(r"/x\134y"), r"/x\y");
    }
}
