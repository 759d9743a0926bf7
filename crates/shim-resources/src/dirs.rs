//! Instance mounts: host directories bind-mounted into containers.

use std::path::Path;

use shim_fs::Dir;

use crate::error::{ResourcesError, Result};

/// Makes sure the host directory `path` exists. A missing one is created world-writable
/// (0777, regardless of the umask) so any container user can write to it, its missing parents
/// 0755; an existing one is left exactly as it is (on SSH fleets the host admin owns its
/// permissions). Returns whether it was created. `path` must be absolute.
pub fn ensure_instance_dir(path: &Path) -> Result<bool> {
    if !path.is_absolute() {
        return Err(ResourcesError::io(
            "create",
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path must be absolute"),
        ));
    }
    match fs_err::symlink_metadata(path) {
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ResourcesError::io("stat", path, e)),
    }
    // Missing ancestors, outermost first, below the deepest one that exists.
    let mut missing = vec![path];
    let mut existing = path;
    while let Some(parent) = existing.parent() {
        existing = parent;
        match fs_err::symlink_metadata(parent) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing.push(parent),
            Err(e) => return Err(ResourcesError::io("stat", parent, e)),
        }
    }
    // Each made through its parent's handle and opened without following a link before its
    // mode is set: the directory may be one a task's container shares (an instance mount of
    // another task), where a link swapped in after the mkdir would have the chmod change the
    // mode of what it points to.
    let mut dir = Dir::open(existing)?;
    let mut created = false;
    while let Some(next) = missing.pop() {
        let name = next.file_name().ok_or_else(|| {
            ResourcesError::io("create", next, std::io::ErrorKind::InvalidInput.into())
        })?;
        let mode = if missing.is_empty() { 0o777 } else { 0o755 };
        (dir, created) = dir.create_dir_unsynced(name, mode, None)?;
    }
    // Not created: made concurrently by someone else, theirs, left alone.
    if created {
        tracing::info!(path = %path.display(), "instance mount directory created");
    }
    Ok(created)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn mode(p: &Path) -> u32 {
        fs_err::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn creates_missing_dir_and_parents_with_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("a/b/c");
        // A restrictive umask must not narrow the modes.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
        let created = ensure_instance_dir(&target);
        nix::sys::stat::umask(old);
        assert!(created.unwrap());
        assert_eq!(mode(&target), 0o777);
        assert_eq!(mode(&tmp.path().join("a")), 0o755);
        assert_eq!(mode(&tmp.path().join("a/b")), 0o755);
    }

    #[test]
    fn leaves_existing_dir_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("d");
        fs_err::create_dir(&target).unwrap();
        fs_err::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).unwrap();
        fs_err::write(target.join("data"), "x").unwrap();
        assert!(!ensure_instance_dir(&target).unwrap());
        assert_eq!(mode(&target), 0o700);
        assert_eq!(fs_err::read_to_string(target.join("data")).unwrap(), "x");
    }

    #[test]
    fn rejects_relative_paths() {
        assert!(ensure_instance_dir(Path::new("relative/dir")).is_err());
    }
}
