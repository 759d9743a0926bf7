//! Crash states, enumerated (built with `cfg(test)` or the `test-support` feature only): the
//! method of ALICE (OSDI '14) and CrashMonkey (OSDI '18), in process.
//!
//! 1. [`Recorder::start`] snapshots a root directory; a [`crate::Dir`] given the recorder
//!    ([`crate::Dir::with_recorder`]) records every operation that changes what a crash
//!    leaves, in the order they took effect ([`Op`]): file creation (`O_CREAT|O_EXCL`), writes
//!    (offset and bytes), fsync of a file, `renameat`, fsync of a directory, `unlinkat`,
//!    `mkdirat`, rmdir, `linkat`, `fchmod`. Handles opened from such a handle carry it too.
//! 2. [`explore`] replays the [`Log`] on the snapshot and builds, at every crash point (every
//!    prefix of the log), the states a crash could leave: each operation not yet made durable
//!    by an fsync applied or undone, each write not yet fsynced kept, dropped or torn (see
//!    [`explore`] for the model), bounded by [`Limits`].
//! 3. A test materialises each state ([`Tree::materialise`]) into a fresh directory, runs its
//!    start-up on it, and checks what it finds against what was acknowledged before the
//!    crash point ([`Recorder::position`] after a call returned).
//!
//! [`Recorder::inject`] leaves a step of the durable writes out ([`Bug`]), so that a test can
//! show the enumeration catches it. [`Log::live`] against [`Tree::read`] checks that no
//! operation bypassed the recorder. Owners (`fchown`) are not modelled.
//!
//! ```
//! use std::ops::ControlFlow;
//! use shim_fs::crash::{Limits, Node, Recorder, explore};
//! use shim_fs::{Dir, WriteOptions};
//!
//! let root = tempfile::tempdir()?;
//! let dir = Dir::open(root.path())?;
//! dir.write_atomic("state", b"old", &WriteOptions::default())?;
//! let recorder = Recorder::start(root.path())?;
//! let dir = dir.with_recorder(recorder.clone());
//! dir.write_atomic("state", b"new", &WriteOptions::default())?;
//! let log = recorder.log();
//! let stats = explore(&log, &Limits::default(), |state| {
//!     let Some(Node::File { data, .. }) = state.tree.lookup("state") else { panic!() };
//!     assert!(data == b"old" || data == b"new", "{}", state.describe(&log));
//!     ControlFlow::Continue(())
//! });
//! assert_eq!(stats.points, log.ops.len() + 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod explore;
mod record;
mod tree;

pub use explore::{CrashState, Fate, Limits, Stats, explore};
pub(crate) use record::Session;
pub use record::{Bug, Log, NodeId, Op, Recorder};
pub use tree::{Node, Tree};

#[cfg(test)]
mod tests;
