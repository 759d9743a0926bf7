//! Durable file writes for the shim, in one place.
//!
//! - [`Dir`]: a directory handle. Every operation is relative to it (`openat`, `renameat`,
//!   `fstatat`, `unlinkat`, `linkat`, `mkdirat`), names are single components, and a symbolic
//!   link is never followed: [`Dir::open_nofollow`], [`Dir::open_dir`] and
//!   [`Dir::create_dir`] refuse a link where a directory is expected, and once a directory is
//!   open, replacing its path by a link redirects nothing.
//! - Atomic replace, [`Dir::write_atomic`] (bytes) and [`Dir::write_atomic_with`] (a writer
//!   callback, e.g. a download): temp file in the same directory (`O_CREAT|O_EXCL|O_NOFOLLOW`,
//!   the mode set explicitly whatever the umask, the owner set when asked), write, fsync,
//!   rename over the target, fsync of the directory. [`WriteOptions::preserve_existing`]
//!   keeps an existing file's mode and owner. [`Dir::create_new_atomic`] publishes with
//!   `linkat` instead, so the first write wins. [`Dir::remove_stale_temps`] removes what a
//!   crashed process left.
//! - [`Dir::read_file`]: a bounded read of a regular file (never a link, FIFO or device).
//! - On a handle, also: [`Dir::stat`] (never following a link), [`Dir::names`],
//!   [`Dir::remove_file`], [`Dir::set_mode`] (`fchmod` of the directory itself) and
//!   [`Dir::sync`].
//! - A new directory with one file, durable at one file fsync and one fsync of the parent:
//!   [`Dir::prepare_dir`] makes it ahead under a hidden name (subdirectories, an empty file,
//!   the directory fsynced), [`PreparedDir::publish`] writes and fsyncs the file and renames
//!   the directory to its name (never over an existing one); [`GroupSync`] shares one fsync
//!   of a directory among concurrent callers (a group commit).
//! - [`FileLock`]: an exclusive `flock` on a file, held until dropped (one shim per home).
//! - Path forms of the same: [`write_atomic`], [`write_atomic_with`], [`create_new_atomic`],
//!   [`read_file`] (the directory part of the path is trusted and opened following links).
//!
//! - On a handle, for moves and removals: [`Dir::rename`] (`renameat`, to this or another
//!   handle), [`Dir::remove_dir`] and [`Dir::remove_tree`] (never following a link).
//!
//! Errors: one [`FsError`] enum naming the path and the [`Step`] that failed. With `cfg(test)` or
//! the `test-support` feature, the `fault` module injects a failure or a crash at any step,
//! and the `crash` module records the durable operations made through a handle and builds every
//! state a crash could leave after each of them (ALICE's and CrashMonkey's method).
//!
//! Crash safety is tested here once (fault injection at every step, a writer killed with
//! SIGKILL at random moments, modes under every umask); the other crates use this crate
//! instead of their own copies.

mod atomic;
#[cfg(any(test, feature = "test-support"))]
pub mod crash;
mod dir;
mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fault;
mod group;
mod lock;
mod prepared;
mod tap;

pub use atomic::{
    TempFile, WriteOptions, create_new_atomic, is_temp_of, read_file, write_atomic,
    write_atomic_with,
};
pub use dir::{Dir, FileInfo, FileKind, Owner, REMOVE_DEPTH};
pub use error::{FsError, Result, Step};
pub use group::{GroupStats, GroupSync};
pub use lock::FileLock;
pub use prepared::PreparedDir;

#[cfg(test)]
mod tests;

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
