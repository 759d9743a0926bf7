//! Block volumes: find the cloud's device, format it only when it is confirmed blank and the
//! volume asks for it, mount it under the volumes root, and unmount it on release.
//!
//! Safety rules, in order:
//! - the device must be a block device of non-zero size (waited for, bounded);
//! - a device with any file system is never formatted, `init_fs` or not;
//! - "blank" (`blkid -p` exit code 2) must be confirmed by [`VolumeConfig::blank_confirmations`]
//!   further probes before `mkfs.ext4` runs, and only when `init_fs` is set; a blank device
//!   without `init_fs` is an error;
//! - a signature that is not a file system (partition table, RAID member, LUKS) is an error
//!   (a partitioned disk is used by its first partition where the cloud names one: AWS by
//!   `lsblk`, GCP by its `google-<name>-part1` link);
//! - only the root of a file system we created is made world-writable (0777);
//! - release unmounts only a path under the volumes root that `/proc/self/mountinfo` lists as a
//!   mount point; anything else is a no-op, so release is idempotent.
//!
//! Concurrency: mount(2), umount(2) (which can block for seconds while ext4 flushes), the
//! mount table and the directory work go through a [`Mounter`] (the real one is
//! [`SystemMounter`]; a recording fake is `fake::FakeMounter`) and run on tokio's blocking
//! pool, never on an async worker. Operations are serialized per mount point and, for
//! `prepare`, per device (always in that order), so two tasks sharing a blank volume can never
//! both decide to format it, while releases of different volumes run in parallel.
//!
//! Files: this module (the [`VolumeManager`] trait, [`VolumeConfig`]), `mounter.rs` (the
//! mount system calls behind [`Mounter`]), `parse.rs` (pure: `blkid`, `lsblk` and mountinfo
//! outputs), `block.rs` ([`BlockVolumes`]: resolve, probe, format, mount, unmount, and its
//! locks).

mod block;
mod mounter;
mod parse;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use shim_task::{MountedVolume, VolumeSpec};

use crate::error::Result;

pub use block::BlockVolumes;
pub use mounter::{Mounter, SystemMounter};
pub use parse::{
    Probe, aws_fallback_names, find_aws_device, is_mount_point_in, mount_at, mount_points,
    parse_blkid,
};

/// Where volumes are mounted by default.
pub const DEFAULT_VOLUMES_ROOT: &str = "/mnt/disks/dstack-volumes";

/// Prepares and releases a task's volumes.
#[async_trait]
pub trait VolumeManager: Send + Sync {
    /// Finds the volume's device, formats it if needed and allowed, and mounts it at
    /// `<volumes root>/<name>`. Already mounted there: returns it as is.
    async fn prepare(&self, spec: &VolumeSpec) -> Result<MountedVolume>;

    /// Unmounts the volume if its mount point is mounted; a no-op otherwise (idempotent).
    async fn release(&self, volume: &MountedVolume) -> Result<()>;

    /// The host path a volume of this name is mounted at.
    fn mount_point(&self, name: &str) -> PathBuf;
}

/// Paths and time limits of [`BlockVolumes`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct VolumeConfig {
    /// Mount points are `<root>/<volume name>`.
    pub root: PathBuf,
    /// How long to wait for the resolved device to be a non-empty block device.
    pub device_wait: Duration,
    /// How long to poll for an AWS device to appear in `lsblk`.
    pub resolve_wait: Duration,
    /// Pause between polls.
    pub poll_interval: Duration,
    /// How many further probes must confirm "blank" before formatting.
    pub blank_confirmations: u32,
    /// Pause between those probes.
    pub confirm_interval: Duration,
    /// Where GCP's `google-<device name>` links live.
    pub gcp_by_id_dir: PathBuf,
    /// Where `lsblk` names and `/dev/…` device names are looked up.
    pub dev_dir: PathBuf,
    /// The mount table to read.
    pub mountinfo: PathBuf,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from(DEFAULT_VOLUMES_ROOT),
            device_wait: Duration::from_secs(10),
            resolve_wait: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            blank_confirmations: 3,
            confirm_interval: Duration::from_secs(1),
            gcp_by_id_dir: PathBuf::from("/dev/disk/by-id"),
            dev_dir: PathBuf::from("/dev"),
            mountinfo: PathBuf::from("/proc/self/mountinfo"),
        }
    }
}

impl VolumeConfig {
    /// Defaults with another volumes root.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            ..Self::default()
        }
    }

    /// Short waits, for tests (`cfg(test)` or feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    #[must_use]
    pub fn fast(mut self) -> Self {
        self.device_wait = Duration::from_millis(500);
        self.resolve_wait = Duration::from_millis(500);
        self.poll_interval = Duration::from_millis(50);
        self.confirm_interval = Duration::from_millis(10);
        self
    }
}
