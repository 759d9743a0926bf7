//! The crate's error type: every error names the path and the step that failed. Its `Display`
//! describes its own level only; the system's error is its `source()`.

use std::path::{Path, PathBuf};

/// Result with this crate's [`FsError`].
pub type Result<T, E = FsError> = std::result::Result<T, E>;

/// The operation an [`FsError`] happened in. The five steps of an atomic replace
/// ([`Step::CreateTemp`], [`Step::Write`], [`Step::SyncFile`], [`Step::Rename`] (or
/// [`Step::Link`]), [`Step::SyncDir`]) are also the points where tests inject faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Step {
    /// Opening a directory handle.
    OpenDir,
    /// Opening a file to read it.
    Open,
    /// `fstat`/`fstatat`.
    Stat,
    /// Reading a file.
    Read,
    /// Creating a directory.
    CreateDir,
    /// Creating a file (other than an atomic write's temp file).
    Create,
    /// Creating the temp file beside the target (`O_CREAT|O_EXCL|O_NOFOLLOW`).
    CreateTemp,
    /// Setting a mode (`fchmod`).
    SetMode,
    /// Setting an owner (`fchown`).
    SetOwner,
    /// Writing the content.
    Write,
    /// `fsync` of the written file.
    SyncFile,
    /// Renaming the temp file over the target.
    Rename,
    /// Linking the temp file to a target that must not exist yet.
    Link,
    /// `fsync` of the directory, making the rename (or creation) durable.
    SyncDir,
    /// Removing a file.
    Remove,
    /// Listing a directory.
    List,
    /// Taking a file lock (`flock`).
    Lock,
}

impl Step {
    /// What the step does, for messages (`"fsync"`, `"rename into place"`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OpenDir => "open directory",
            Self::Open => "open",
            Self::Stat => "stat",
            Self::Read => "read",
            Self::CreateDir => "create directory",
            Self::Create => "create",
            Self::CreateTemp => "create a temp file for",
            Self::SetMode => "set the mode of",
            Self::SetOwner => "set the owner of",
            Self::Write => "write",
            Self::SyncFile => "fsync",
            Self::Rename => "rename into place",
            Self::Link => "link into place",
            Self::SyncDir => "fsync directory",
            Self::Remove => "remove",
            Self::List => "list directory",
            Self::Lock => "lock",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What went wrong, with the path concerned and the step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FsError {
    /// A system call failed.
    #[error("cannot {step} {}", path.display())]
    Io {
        /// The step that failed.
        step: Step,
        /// The path concerned (the temp file's path for steps on the temp file).
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The path is not of the required kind (a symbolic link, a FIFO or a directory where a
    /// regular file is required, a link or a file where a directory is required). Nothing was
    /// read or written through it.
    #[error("refusing to {step} {}: it is {found}, not {expected}", path.display())]
    WrongType {
        /// The step that refused it.
        step: Step,
        /// The path.
        path: PathBuf,
        /// What it is (`"a symbolic link"`, …).
        found: &'static str,
        /// What it must be (`"a regular file"`, `"a directory"`).
        expected: &'static str,
    },
    /// A bounded read found more bytes than allowed.
    #[error("refusing to read {}: larger than {max} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A name relative to a directory handle is not a single path component.
    #[error("invalid file name {name:?} in {}: it must be one path component", dir.display())]
    InvalidName {
        /// The directory.
        dir: PathBuf,
        /// The rejected name.
        name: String,
    },
}

impl FsError {
    pub(crate) fn io(step: Step, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            step,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn sys(step: Step, path: impl Into<PathBuf>, errno: rustix::io::Errno) -> Self {
        Self::io(step, path, errno.into())
    }

    /// The step that failed (`None` for [`FsError::InvalidName`] and [`FsError::TooLarge`]).
    pub fn step(&self) -> Option<Step> {
        match self {
            Self::Io { step, .. } | Self::WrongType { step, .. } => Some(*step),
            Self::TooLarge { .. } | Self::InvalidName { .. } => None,
        }
    }

    /// The path concerned.
    pub fn path(&self) -> &Path {
        match self {
            Self::Io { path, .. } | Self::WrongType { path, .. } | Self::TooLarge { path, .. } => {
                path
            }
            Self::InvalidName { dir, .. } => dir,
        }
    }

    /// The `io::ErrorKind` of a failed system call, if that is what this is.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            Self::Io { source, .. } => Some(source.kind()),
            _ => None,
        }
    }

    /// Whether the path (or a directory on the way) does not exist.
    pub fn is_not_found(&self) -> bool {
        self.io_kind() == Some(std::io::ErrorKind::NotFound)
    }
}

#[cfg(test)]
mod tests {
    use shim_util::testing::assert_each_cause_once;

    /// A standard reporter prints the system's error once.
    #[test]
    fn a_reporter_prints_the_cause_once() {
        let e = crate::read_file("/nonexistent/dir/file", 10).unwrap_err();
        assert_eq!(
            assert_each_cause_once(&e),
            "cannot open directory /nonexistent/dir: No such file or directory (os error 2)"
        );
    }
}
