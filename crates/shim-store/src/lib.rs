//! Durable per-task state of the dstack shim.
//!
//! Layout under the shim home:
//!
//! ```text
//! <home>/tasks/                 0700
//! <home>/tasks/<task id>/       0700  only the shim reads or writes here
//!     task.json                 0600  {"schema_version": 1, "task": <TaskRecord>}
//!     pull.log                        the daemon's raw pull progress
//!     runner/                   0755  the only part bind-mounted into the container
//! ```
//!
//! Every write is durable and atomic (temp file in the task directory, fsync, rename over
//! `task.json`, fsync the directory), so after a crash at any point the state file holds the
//! old or the new record, never a mix. Registry credentials never reach the disk: the config's
//! password does not serialize and [`Store::write`] strips credentials again.
//!
//! [`Store::scan`] never fails because of one task: an unusable state file (empty, truncated,
//! garbage, a newer schema) is moved aside as `task.json.corrupt-<unix ms>` and reported, and
//! directories that are not tasks are reported and left alone.
//!
//! The API is blocking (std filesystem calls); async callers use `spawn_blocking`.

mod envelope;
mod error;
mod store;
#[cfg(test)]
mod tests;

pub use envelope::{MAX_RECORD_BYTES, SCHEMA_VERSION};
pub use error::{RecordError, Result, StoreError};
pub use store::{
    DIR_MODE, FILE_MODE, PULL_LOG, RUNNER_DIR, RUNNER_DIR_MODE, STATE_FILE, ScanEntry, Store,
    TASKS_DIR, TaskPaths,
};
