//! The mount table of this process's mount namespace (`/proc/self/mountinfo`), read with
//! shim-resources' parser (the one the shim uses for its volumes).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::cmd;

/// Every mount point, in the table's order, byte for byte.
pub fn mount_points() -> Result<Vec<PathBuf>> {
    let table = fs_err::read_to_string("/proc/self/mountinfo")?;
    Ok(shim_resources::volumes::mount_points(&table).collect())
}

/// Removes `tree` if it exists, after unmounting whatever is mounted inside it (never deletes
/// through a mount point into the host's `/proc`, `/sys` or `/dev`).
pub fn remove_tree(tree: &Path) -> Result<()> {
    if !tree.exists() {
        return Ok(());
    }
    unmount_under(tree)?;
    println!("removing {}", tree.display());
    fs_err::remove_dir_all(tree)?;
    Ok(())
}

/// Unmounts (lazily, deepest first) every mount point at or below `tree`.
pub fn unmount_under(tree: &Path) -> Result<()> {
    let mut points: Vec<PathBuf> = mount_points()?
        .into_iter()
        .filter(|point| point.starts_with(tree))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        println!("unmounting {}", point.display());
        cmd::run(cmd::cmd("umount").arg("--lazy").arg(&point))?;
    }
    if mount_points()?.iter().any(|point| point.starts_with(tree)) {
        bail!("something is still mounted under {}", tree.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_mounted() {
        assert!(mount_points().unwrap().contains(&PathBuf::from("/")));
    }
}
