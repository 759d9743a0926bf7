//! Host resources of the shim: GPUs, host users' authorized_keys, block volumes, instance
//! mount directories and host facts.
//!
//! This crate knows nothing of HTTP, of tasks' containers or of the Docker API. Its one use of
//! Docker: AMD and Tenstorrent GPUs are listed, as dstack's Go shim does, by running the
//! vendor's tool image with the `docker` CLI (`docker run --rm --device … dstackai/amd-smi`,
//! `dstackai/tt-smi`), through the [`CommandRunner`](shim_util::CommandRunner) like every other host tool.
//!
//! Each resource the engine drives sits behind a small `Send + Sync` trait usable as
//! `Arc<dyn Trait>`, with a real implementation tested against the real thing (temporary
//! homes, loop devices, real directories) and, under `cfg(test)` or the `test-support` feature,
//! fakes that record calls and fail on demand (the `fake` module: volumes, the mount system
//! calls, authorized_keys):
//!
//! - [`gpu`] — detection ([`GpuDetector`]: vendor from device paths, GPUs from the vendor
//!   tool; its seams are the injected command runner and device roots, not a trait), parsing
//!   per vendor, the in-memory [`GpuLock`], and placement by interconnect
//!   ([`gpu::Topology`] from `nvidia-smi topo -m`, [`gpu::choose`]). The engine takes the
//!   detected [`HostGpus`] as data ([`HostGpus::fake_nvidia`] in tests and for
//!   `--fake-gpus`) and a real lock, which needs no fake. [`gpu::health`]: which NVIDIA GPUs
//!   must not take new tasks, and why (`nvidia-smi -q` memory-error state, the driver's XIDs
//!   in the kernel log).
//! - [`keys`] — [`AuthorizedKeys`] / [`AuthorizedKeysManager`]: the shim-owned lines of a user's
//!   file are exactly the keys of that user's live tasks; lines of unknown origin stay while a
//!   live task's keys are unknown ([`AuthorizedKeys::hold_unknown`]); every read and write is
//!   relative to a handle of `~/.ssh` opened without following links.
//! - [`volumes`] — [`VolumeManager`] / [`BlockVolumes`]: resolve, probe, format (only when
//!   confirmed blank and asked to), mount, unmount; the system calls behind [`Mounter`], run on
//!   the blocking pool, locked per mount point and device.
//! - [`dirs`] — [`ensure_instance_dir`]: a missing instance-mount directory is created 0777
//!   (its missing parents 0755), an existing one is left exactly as it is.
//! - [`cgroup`] — [`cgroup::Cgroups`] finds a container's control group from its main
//!   process, [`cgroup::Cgroup::usage`] reads its CPU seconds, memory, peak and OOM kills
//!   (cgroup v2 or v1).
//! - [`host`] — [`HostInfo`], [`host::collect`] (facts as upstream computes them; 0 when
//!   unreadable), [`write_host_info`] and [`write_host_info_once`]: upstream's
//!   `host_info.json`.
//! - Host tools run through the injected [`CommandRunner`](shim_util::CommandRunner) of [`shim_util`] (re-exported:
//!   [`SystemCommandRunner`](shim_util::SystemCommandRunner); `shim_util::fake::ScriptedCommandRunner` answers from a script in tests).
//!
//! Durable writes (authorized_keys, host_info.json) go through [`shim_fs`].
//!
//! Errors: one [`ResourcesError`] enum; every variant names the path, device, user or command.

mod blocking;
pub mod cgroup;
pub mod dirs;
pub mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub mod gpu;
pub mod host;
pub mod keys;
pub mod volumes;

pub use dirs::ensure_instance_dir;
pub use error::{ResourcesError, Result};
#[cfg(any(test, feature = "test-support"))]
pub use fake::StaticUserDb;
pub use gpu::{CdiRegistry, GpuDetector, GpuInfo, GpuLock, GpuVendor, HostGpus};
pub use host::{HOST_INFO_FILE, HostInfo, write_host_info, write_host_info_once};
pub use keys::{AuthorizedKeys, AuthorizedKeysManager, SystemUserDb, UserDb, UserEntry};
pub use volumes::{
    BlockVolumes, DEFAULT_VOLUMES_ROOT, Mounter, SystemMounter, VolumeConfig, VolumeManager,
};

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
