//! The shim's components: the `dstack-runner` binary (bind-mounted into every task container)
//! and the `dstack-shim` binary itself.
//!
//! `Components` (feature `install`) reports each one's state (`GET /api/components`) and installs a new binary
//! from a URL (`POST /api/components/install`): the download is streamed into a temporary file
//! (0755) beside the target, fsynced and renamed over the target, and the directory fsynced
//! (`shim_fs::write_atomic_with`), so a reader of the path sees the old binary or the new one,
//! never a partial file. Replacing the running shim's own binary is safe: the running process
//! keeps the old inode until it is restarted.
//!
//! Downloads use `ureq` (blocking, in `spawn_blocking`) over http or https (rustls with the
//! webpki roots; the usual `http(s)_proxy` variables apply). URLs are logged without their
//! query string (presigned URLs carry credentials there).
//!
//! A binary's version is read from `<binary> --version` (output `... version X`), with a
//! timeout, and cached per file version.
//!
//! The crate knows nothing of HTTP: its [`ComponentInfo`] serialises as one entry of
//! `GET /api/components` (`shim-http` uses these types as they are), and `shim-http` maps its
//! [`ComponentsError`] onto the API's error kinds. Feature `install` (default) brings `Components` and
//! its downloads (ureq); without it the crate is its types, version reading and [`upgrade`].
//!
//! Modules: `version` (reading versions), `download` (URL checks, the download into place),
//! `manager` (`Components`: per-component state, background installs), [`upgrade`] (the
//! file side of replacing the running shim: does the installed binary differ from the running
//! one, its digest, the rollback to the running image, the record of a rolled-back upgrade).

mod component;
#[cfg(feature = "install")]
mod download;
mod error;
#[cfg(feature = "install")]
mod manager;
pub mod upgrade;
mod version;

pub use component::{ComponentInfo, ComponentName, ComponentStatus};
#[cfg(feature = "install")]
pub use download::redact_url;
pub use error::ComponentsError;
#[cfg(feature = "install")]
pub use manager::{Components, ComponentsConfig};
pub use version::{FileKey, binary_version, parse_version};

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(all(doctest, feature = "install"))]
pub struct ReadmeDoctests;
