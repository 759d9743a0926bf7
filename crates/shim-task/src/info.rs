//! What the API reports about a task (`TaskInfo`), and the resources a task holds.

use serde::{Deserialize, Serialize};

use crate::ids::TaskId;
use crate::ssh::PublicKey;
use crate::status::TaskStatus;

/// A published port: container port → host port on 127.0.0.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortMapping {
    /// Host port.
    pub host: u16,
    /// Container port.
    pub container: u16,
}

/// Image pull progress, summed over the image's layers: what a pull reports
/// (`shim-runtime` uses this type) and what the task view shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PullProgress {
    /// Bytes downloaded so far.
    pub downloaded_bytes: u64,
    /// Bytes known to be extracted so far: engines differ in what they report of extraction
    /// (the rule per engine is on shim-runtime's re-export of this type); all of them once
    /// the pull has finished.
    pub extracted_bytes: u64,
    /// Total bytes of the layers whose size is known so far.
    pub total_bytes: u64,
    /// Whether every layer's size is known (the total will not grow any more).
    pub is_total_bytes_final: bool,
}

/// The API's view of a task (`GET /api/tasks/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInfo {
    /// Task id.
    pub id: TaskId,
    /// Current status.
    pub status: TaskStatus,
    /// `""` until terminated.
    pub termination_reason: String,
    /// Why, readable; may be empty.
    pub termination_message: String,
    /// `null` until known; `[]` in host network mode.
    pub ports: Option<Vec<PortMapping>>,
    /// `null` until a pull began.
    pub image_pull_progress: Option<PullProgress>,
    /// The container's name (known from submit on).
    pub container_name: String,
    /// The container's id, once created.
    pub container_id: String,
    /// GPU ids, once acquired. On the wire `gpus_ids`, upstream's spelling
    /// (`runner/internal/shim/api/schemas.go`, `TaskInfoResponse`); `gpu_ids` is read too.
    #[serde(rename = "gpus_ids", alias = "gpu_ids")]
    pub gpu_ids: Option<Vec<String>>,
}

/// Host SSH keys a task added to a user's authorized_keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostKeysGrant {
    /// The host user.
    pub user: String,
    /// The keys added for this task.
    pub keys: Vec<PublicKey>,
    /// The upstream shim added them (a task adopted from its state file): its lines carry no
    /// marker, and they go as upstream removes them, every line with one of these keys that
    /// no live task needs (upstream `runner/internal/shim/authorized_keys.go`,
    /// `RemovePublicKeys`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub upstream: bool,
}

/// A volume a task mounted on the host.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MountedVolume {
    /// The volume name.
    pub name: String,
    /// The host mount point.
    pub mount_point: String,
    /// The block device (empty when recovered from a container's mounts).
    #[serde(default)]
    pub device: String,
}

/// The host resources a task acquired and has not yet released.
///
/// Each entry is recorded as soon as it is acquired and removed once it is released, so release
/// frees exactly what was acquired and a failed release is retried with what is left. `released`
/// becomes true once release has completed; it never goes back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// Locked GPU ids (NVIDIA UUIDs, AMD render nodes, indexes otherwise).
    #[serde(default)]
    pub gpus: Vec<String>,
    /// Keys added to a host user's authorized_keys.
    #[serde(default)]
    pub host_keys: Option<HostKeysGrant>,
    /// Volumes mounted on the host.
    #[serde(default)]
    pub volumes: Vec<MountedVolume>,
    /// Instance-mount directories the shim created (left in place on release: they hold data).
    #[serde(default)]
    pub created_dirs: Vec<String>,
    /// The task may hold host key lines that nobody can name (its state file was unreadable, or
    /// it is a container of another shim that left none): while it lives, marked lines of
    /// unknown origin stay in the users' authorized_keys (SPEC §7). Released like a resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_keys: Option<UnknownKeys>,
    /// Release completed: nothing is held any more.
    #[serde(default)]
    pub released: bool,
}

/// A hold on the marked authorized_keys lines of unknown origin (see
/// [`Resources::unknown_keys`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UnknownKeys {
    /// The host user, when known (the config survived but the key lines did not); `None`
    /// protects the unknown-origin lines of every user.
    #[serde(default)]
    pub user: Option<String>,
}

impl Resources {
    /// Whether anything still needs releasing.
    pub fn holds_any(&self) -> bool {
        !self.gpus.is_empty()
            || self.host_keys.is_some()
            || !self.volumes.is_empty()
            || self.unknown_keys.is_some()
    }
}
