//! The pure core of the shim: task types and the decisions about them.
//!
//! This crate does no IO, has no async runtime and no clock of its own (time is an argument):
//! the engine feeds it events and carries out the actions it returns. That makes every
//! decision testable by property tests over random event sequences.
//!
//! - [`ids`]: validated task ids and names (they become directory and container names).
//! - [`status`]: statuses and termination reasons as they appear on the wire.
//! - [`config`]: the submit body with defaults and validation.
//! - [`ssh`]: OpenSSH public key validation and SHA256 fingerprints.
//! - [`info`]: the API's task view and the record of acquired resources.
//! - [`record`]: the persisted part of a task.

pub mod config;
pub mod ids;
pub mod info;
pub mod record;
pub mod ssh;
pub mod status;

pub use config::{
    ConfigError, GpuDevice, InstanceMountPoint, NetworkMode, Secret, TaskConfig, VolumeBackend,
    VolumeMountPoint, VolumeSpec,
};
pub use ids::{InvalidId, TaskId, TaskName};
pub use info::{HostKeysGrant, MountedVolume, PortMapping, PullProgress, Resources, TaskInfo};
pub use record::TaskRecord;
pub use ssh::{InvalidKey, PublicKey};
pub use status::{TaskStatus, TerminationReason};
