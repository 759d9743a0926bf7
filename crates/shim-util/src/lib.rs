//! The mechanisms every crate of the dstack shim shares and none of them owns, each written
//! once:
//!
//! - `cmd` — running a host program: a [`Command`] (program, arguments, an optional time
//!   limit) run by a [`CommandRunner`]. [`SystemCommandRunner`] is the real one (stdin closed,
//!   output collected, the program killed when its time is up or when the caller stops
//!   waiting); the recording fake, `fake::ScriptedCommandRunner`, is built with `cfg(test)` or
//!   the `test-support` feature. `shim-resources` (GPU tools, `lsblk`, `blkid`, `mkfs.ext4`),
//!   `shim-dcgm` (`dcgmi`, `dcgm-exporter -v`) and `shim-components` (`<binary> --version`)
//!   run their programs through it.
//! - `error` — [`error_chain`]: an error and its causes on one line, `a: b: c`. The
//!   convention of the workspace's error types, which it relies on: an error's `Display`
//!   describes its own level only and never repeats its source's text; the cause is the
//!   `source()`. With `test-support`, `testing::assert_each_cause_once` checks an error
//!   against it.
//! - `keyed` — [`KeyedLocks`]: one async lock per key, made on demand (a mount point's
//!   prepares and releases, in `shim-resources` and the engine).
//!
//! This crate depends on no other crate of the shim, so each of them can depend on it.

mod cmd;
mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
mod keyed;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;

pub use cmd::{Command, CommandError, CommandOutput, CommandRunner, SystemCommandRunner};
pub use error::{BoxError, error_chain};
pub use keyed::KeyedLocks;

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
