//! An exclusive advisory lock on a file (`flock`), for "one process at a time" rules: one
//! shim per home, one dev-env run per machine.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use crate::error::{FsError, Result, Step};

/// An exclusive `flock` on a file, held until this value is dropped or the process ends. The
/// descriptor is close-on-exec, so a program the holder executes does not inherit the lock.
#[derive(Debug)]
pub struct FileLock {
    // Closing the descriptor releases the lock.
    _file: File,
    path: PathBuf,
}

impl FileLock {
    /// Takes the lock at once; `Ok(None)` when another open file holds it (another process,
    /// or another `FileLock` of this one). The file is created (0600) if missing.
    pub fn try_exclusive(path: impl AsRef<Path>) -> Result<Option<Self>> {
        let path = path.as_ref();
        let file = open(path)?;
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(Self::held(file, path))),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(FsError::io(Step::Lock, path, e.into())),
        }
    }

    /// Takes the lock, waiting for its holder to let go.
    pub fn exclusive(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = open(path)?;
        rustix::fs::flock(&file, FlockOperation::LockExclusive)
            .map_err(|e| FsError::io(Step::Lock, path, e.into()))?;
        Ok(Self::held(file, path))
    }

    /// The locked file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn held(file: File, path: &Path) -> Self {
        Self {
            _file: file,
            path: path.to_path_buf(),
        }
    }
}

fn open(path: &Path) -> Result<File> {
    // Errors name the path through `FsError::io` (so no fs-err here). Never through a symbolic
    // link (the crate's rule): a link planted at the lock path is an error, not a file
    // created or locked elsewhere.
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
        .map_err(|e| FsError::io(Step::Open, path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symbolic_link_at_the_lock_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        let path = dir.path().join("x.lock");
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        assert!(FileLock::try_exclusive(&path).is_err());
        assert!(!elsewhere.exists(), "the lock created the link's target");
    }

    #[test]
    fn one_holder_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.lock");
        let first = FileLock::try_exclusive(&path).unwrap().unwrap();
        assert_eq!(first.path(), path);
        // Another open file description (as another process would have) cannot take it.
        assert!(FileLock::try_exclusive(&path).unwrap().is_none());
        drop(first);
        let again = FileLock::exclusive(&path).unwrap();
        assert!(FileLock::try_exclusive(&path).unwrap().is_none());
        drop(again);
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/x.lock");
        let e = FileLock::try_exclusive(&path).unwrap_err();
        assert!(e.to_string().contains("no/such/x.lock"), "{e}");
    }
}
