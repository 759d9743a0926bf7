//! The store's errors. Their `Display` describes their own level only; the cause is their
//! `source()` (print the whole with [`shim_util::error_chain`]).

use std::io;
use std::path::PathBuf;

use shim_task::TaskId;

/// What went wrong in a store operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A filesystem operation failed. `context` says what the store was doing; the source
    /// (an `fs-err` error, or a `shim_fs::FsError` inside an `io::Error` of the same kind)
    /// names the path.
    #[error("{context}")]
    Io {
        /// What the store was doing, e.g. "writing the state of task t1".
        context: String,
        /// The underlying error, with its path.
        #[source]
        source: io::Error,
    },
    /// `create_task_dir` for a task whose directory already holds a state file.
    #[error("task directory {name} already holds a state file ({})", path.display())]
    TaskExists {
        /// The directory's name (the container name).
        name: String,
        /// Its state file.
        path: PathBuf,
    },
    /// `write` for a task whose directory does not exist (never created, or deleted).
    #[error("task {id} has no directory ({}): create it first", path.display())]
    NoTaskDir {
        /// The task.
        id: TaskId,
        /// The missing directory.
        path: PathBuf,
    },
    /// A path the store would use is not what it must be (not a directory, a symlink, or
    /// outside the tasks directory). Never expected with validated ids; refused anyway.
    #[error("unsafe path {}: {why}", path.display())]
    UnsafePath {
        /// The offending path.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A state file exists but cannot be used (see [`RecordError`]). `read` reports this;
    /// `scan` moves such files aside instead.
    #[error("state file {} is unreadable", path.display())]
    Unreadable {
        /// The state file.
        path: PathBuf,
        /// Why.
        #[source]
        source: RecordError,
    },
    /// The record could not be serialized (not expected for a `TaskRecord`).
    #[error("cannot serialize the record of task {id}")]
    Serialize {
        /// The task.
        id: TaskId,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },
}

/// Why a state file is not a usable record. Such a file is never overwritten blindly: `scan`
/// moves it aside as `task.json.corrupt-<unix ms>`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The file is empty (e.g. a crash on a filesystem without ordered writes).
    #[error("the file is empty")]
    Empty,
    /// The file is not JSON, is truncated, or does not hold a task record.
    #[error("not a valid task record")]
    Malformed(#[source] serde_json::Error),
    /// The envelope's schema version is newer than this shim understands.
    #[error("written by a newer shim (schema {0})")]
    NewerSchema(u64),
    /// The envelope's schema version is one no shim ever wrote (0).
    #[error("unknown schema version {0}")]
    UnknownSchema(u64),
    /// The record is for another task than its directory's name says.
    #[error("the record is for task {found}, not for directory {expected}")]
    WrongTask {
        /// The directory's name.
        expected: String,
        /// The id in the record.
        found: TaskId,
    },
    /// The file is larger than any record the shim writes.
    #[error("the file is too large ({0} bytes)")]
    TooLarge(u64),
    /// `task.json` is not a regular file (a directory, a symlink, …).
    #[error("not a regular file")]
    NotAFile,
    /// The file could not be read.
    #[error("cannot read the file")]
    Io(#[source] io::Error),
}

/// The store's result type.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use shim_util::testing::assert_each_cause_once;

    use super::*;

    /// Every variant with a cause, as a standard reporter prints it: each cause once.
    #[test]
    fn a_reporter_prints_each_cause_once() {
        let io = || io::Error::from_raw_os_error(28);
        let json = || serde_json::from_str::<u8>("x").unwrap_err();
        let id = TaskId::new("t1").unwrap();
        for e in [
            StoreError::Io {
                context: "writing the state of task t1".into(),
                source: io(),
            },
            StoreError::Unreadable {
                path: "/x/task.json".into(),
                source: RecordError::Malformed(json()),
            },
            StoreError::Unreadable {
                path: "/x/task.json".into(),
                source: RecordError::Io(io()),
            },
            StoreError::Serialize { id, source: json() },
        ] {
            assert_each_cause_once(&e);
        }
    }
}
