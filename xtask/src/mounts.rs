//! The mount table of this process's mount namespace (`/proc/self/mountinfo`), read with
//! shim-resources' parser (the one the shim uses for its volumes).

use std::path::PathBuf;

use anyhow::Result;

/// Every mount point, in the table's order, byte for byte.
pub fn mount_points() -> Result<Vec<PathBuf>> {
    let table = fs_err::read_to_string("/proc/self/mountinfo")?;
    Ok(shim_resources::volumes::mount_points(&table).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_mounted() {
        assert!(mount_points().unwrap().contains(&PathBuf::from("/")));
    }
}
