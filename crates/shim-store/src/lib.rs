//! Durable per-task state of the dstack shim, in the upstream shim's on-host layout and format.
//!
//! Layout under the shim home (SPEC §5; upstream `runner/internal/shim/docker.go`,
//! `MakeRunnerDir`, and dstack PR #4220):
//!
//! ```text
//! <home>/owner-id                     this shim's owner identity (created once)
//! <home>/runners/                0755
//! <home>/runners/<container name>/ 0700  only the shim reads or writes here
//!     task.json                  0600  upstream's format version 1 + this shim's "rust_shim" field
//!     pull.log                         the daemon's pull progress (repeats left out, 16 MiB at most)
//!     runner/                    0755  the only part bind-mounted into the container
//! <home>/runners/.trash-<name>-<ms>    a task directory being deleted
//! <home>/runners/.spare-<n>            a task directory made ahead of a submit (removed at open)
//! ```
//!
//! Every write is durable and atomic through `shim-fs` (temp file in the task directory,
//! fsync, rename over `task.json`, fsync the directory), so after a crash at any point the
//! state file holds the old or the new record, never a mix. A new task costs one fsync of its
//! record and one of `runners/`, which concurrent submits share ([`Store::create`]: a spare
//! directory made ahead by [`Store::prepare_spares`] gets the record and is renamed into
//! place; `shim_fs::GroupSync` is the group commit). The home and `runners/` are opened
//! once as directory handles; a task directory is opened relative to `runners/` and never
//! through a symbolic link (one in its place is [`StoreError::UnsafePath`]), and its state file
//! is read (bounded, a regular file only) and replaced relative to that handle. Registry
//! credentials never reach the disk.
//!
//! [`Store::scan`] never fails because of one task: an unusable state file (empty, truncated,
//! garbage, a newer format) is moved aside as `task.json.corrupt-<unix ms>` and reported, and
//! directories that are not tasks are reported and left alone. [`Store::delete`] renames a
//! task directory to a trash name before removing it, so a kill during a delete leaves
//! nothing that looks like a task; [`Store::sweep_trash`] finishes such deletes and
//! [`Store::remove_skeleton`] removes what a submit cut short before its first write leaves.
//! Homes of the first release (`tasks/<id>/`, another envelope) are migrated by
//! [`Store::migrate_legacy`].
//!
//! The API is blocking (std filesystem calls); async callers use `spawn_blocking`.

mod error;
mod format;
mod store;
#[cfg(test)]
mod tests;

pub use error::{RecordError, Result, StoreError};
pub use format::{EXTENSION_FIELD, EXTENSION_SCHEMA, FORMAT_VERSION, MAX_RECORD_BYTES, Origin};
pub use store::{
    DIR_MODE, FILE_MODE, LEGACY_TASKS_DIR, Migration, OWNER_FILE, PULL_LOG, RUNNER_DIR,
    RUNNER_DIR_MODE, RUNNERS_DIR, RUNNERS_DIR_MODE, SPARE_PREFIX, SPARES, STATE_FILE, ScanEntry,
    Store, TRASH_PREFIX, TaskPaths, valid_dir_name,
};

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
