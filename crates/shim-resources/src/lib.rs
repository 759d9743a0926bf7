//! Host resources of the shim: GPUs, host users' authorized_keys, block volumes, instance
//! mount directories and host facts.
//!
//! This crate knows nothing of Docker or HTTP. Each resource the engine drives sits behind a
//! small `Send + Sync` trait usable as `Arc<dyn Trait>`, with a real implementation tested
//! against the real thing (temporary homes, loop devices, real directories) and, with the
//! `test-support` feature, fakes that record calls:
//!
//! - [`gpu`] — [`GpuDetector`] (vendor from device paths, GPUs from the vendor tool),
//!   [`HostGpus`] (with [`HostGpus::fake_nvidia`] for GPU-less machines) and [`GpuLock`].
//! - [`keys`] — [`AuthorizedKeys`] / [`AuthorizedKeysManager`]: the shim-owned lines of a user's
//!   file are exactly the keys of that user's live tasks.
//! - [`volumes`] — [`VolumeManager`] / [`BlockVolumes`]: resolve, probe, format (only when
//!   confirmed blank and asked to), mount, unmount.
//! - [`dirs`] — [`ensure_instance_dir`].
//! - [`host`] — [`HostInfo`], [`host::collect`], [`write_host_info_once`].
//! - [`cmd`] — [`CommandRunner`], the injectable way every host tool is run.
//!
//! Errors: one [`Error`] enum; every variant names the path, device, user or command.

pub mod cmd;
pub mod dirs;
pub mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub mod gpu;
pub mod host;
pub mod keys;
pub mod volumes;

pub use cmd::{CommandOutput, CommandRunner, ScriptedCommandRunner, SystemCommandRunner};
pub use dirs::ensure_instance_dir;
pub use error::{Error, Result};
pub use gpu::{GpuDetector, GpuInfo, GpuLock, GpuVendor, HostGpus};
pub use host::{HOST_INFO_FILE, HostInfo, write_host_info, write_host_info_once};
pub use keys::{
    AuthorizedKeys, AuthorizedKeysManager, StaticUserDb, SystemUserDb, UserDb, UserEntry,
};
pub use volumes::{
    BlockVolumes, DEFAULT_VOLUMES_ROOT, Mounter, SystemMounter, VolumeConfig, VolumeManager,
};
