//! Runtime-neutral types exchanged with a [`crate::ContainerRuntime`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::spec::{DeviceMapping, DeviceRequest};

/// Registry credentials. `Debug` never shows the password; the type is not `Serialize` so that
/// it cannot reach a file by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryAuth {
    /// The user name.
    pub username: String,
    /// The password or token (never logged).
    pub password: String,
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// What to pull, and how: [`PullRequest::new`] and the `with_*` methods (fields may be added).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PullRequest {
    /// The full image reference, with a tag or digest (`repo/name:tag`).
    pub image: String,
    /// Registry credentials, if any.
    pub auth: Option<RegistryAuth>,
    /// Where to write the daemon's progress messages (JSON lines), if anywhere.
    pub log_path: Option<PathBuf>,
    /// How long the whole pull may take; `None`: no limit (the stall timeout still applies).
    pub timeout: Option<Duration>,
    /// How long the pull may go without any progress message from the engine (a byte count,
    /// a layer's status, an extraction step) before it fails with
    /// [`crate::RuntimeError::PullStalled`]; `None`: no limit.
    pub stall_timeout: Option<Duration>,
    /// What moves while the engine unpacks in silence ([`DiskProbe`]); `None`: the silent
    /// phase after the last download is judged by [`crate::EXTRACTION_STALL_TIMEOUT`].
    pub disk: Option<DiskProbe>,
}

/// A measure of the engine's data on disk (the used bytes of its data root's file system),
/// read while a pull is silent after its last download: Docker 26–27 on the containerd image
/// store and Podman report nothing while they unpack the layers, and a huge last layer may
/// take longer to unpack than the stall timeout; while this measure changes, the pull is
/// moving. Only read after every layer announced is downloaded (while downloading, the
/// engine's messages tell; the disk would also move for the containers' own writes).
/// Blocking (a `statfs`): the runtime reads it on tokio's blocking pool.
#[derive(Clone)]
pub struct DiskProbe(Arc<dyn Fn() -> Option<u64> + Send + Sync>);

impl DiskProbe {
    /// A probe reading `measure` (`None`: unknown now).
    pub fn new(measure: impl Fn() -> Option<u64> + Send + Sync + 'static) -> Self {
        Self(Arc::new(measure))
    }

    /// The measure now.
    pub fn read(&self) -> Option<u64> {
        (self.0)()
    }
}

impl fmt::Debug for DiskProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DiskProbe")
    }
}

impl PartialEq for DiskProbe {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for DiskProbe {}

impl PullRequest {
    /// A pull of `image` without credentials, log, or any time limit.
    pub fn new(image: impl Into<String>) -> Self {
        Self {
            image: image.into(),
            auth: None,
            log_path: None,
            timeout: None,
            stall_timeout: None,
            disk: None,
        }
    }

    /// With registry credentials (`None`: anonymous).
    #[must_use]
    pub fn with_auth(mut self, auth: Option<RegistryAuth>) -> Self {
        self.auth = auth;
        self
    }

    /// Writing the engine's progress messages to `path` (`None`: nowhere).
    #[must_use]
    pub fn with_log_path(mut self, path: Option<PathBuf>) -> Self {
        self.log_path = path;
        self
    }

    /// With a limit on the whole pull (`None`: none).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// With a limit on the time without progress (`None`: none).
    #[must_use]
    pub fn with_stall_timeout(mut self, stall_timeout: Option<Duration>) -> Self {
        self.stall_timeout = stall_timeout;
        self
    }

    /// With a measure of the engine's data on disk, read while the engine unpacks in silence
    /// (`None`: none; see [`DiskProbe`]).
    #[must_use]
    pub fn with_disk_probe(mut self, disk: Option<DiskProbe>) -> Self {
        self.disk = disk;
        self
    }
}

/// What a container engine can do with GPUs ([`crate::ContainerRuntime::gpu_support`]).
/// Built with [`GpuSupport::new`] (`#[non_exhaustive]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub struct GpuSupport {
    /// The engine as its version answer names it: `Docker 28.5.2`, `Podman 5.4.2`.
    pub engine: String,
    /// The directories it reads CDI specs from, when it applies CDI device requests
    /// (`DeviceRequests` driver `cdi`): Docker's `CDISpecDirs` (Docker 25+ with CDI on, the
    /// default from 28.2), Podman 5+'s defaults (`/etc/cdi`, `/var/run/cdi`: its
    /// Docker-compatible `/info` names none). `None`: it applies none (Docker before 25 or
    /// with CDI off, Podman 4).
    pub cdi_spec_dirs: Option<Vec<PathBuf>>,
    /// Whether it applies upstream's NVIDIA device requests (driver `nvidia`, through NVIDIA's
    /// runtime hook, which the engine cannot say is there): Docker; Podman's Docker API
    /// ignores them.
    pub nvidia_requests: bool,
}

impl GpuSupport {
    /// An engine named `engine`, reading CDI specs from `cdi_spec_dirs` (`None`: no CDI),
    /// applying NVIDIA device requests or not.
    pub fn new(
        engine: impl Into<String>,
        cdi_spec_dirs: Option<Vec<PathBuf>>,
        nvidia_requests: bool,
    ) -> Self {
        Self {
            engine: engine.into(),
            cdi_spec_dirs,
            nvidia_requests,
        }
    }
}

/// A local image as the engine describes it ([`crate::ContainerRuntime::inspect_image`]).
/// Built with [`ImageDetails::new`] (`#[non_exhaustive]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ImageDetails {
    /// The image id (`sha256:…`): what a tag points to.
    pub id: String,
    /// The names pointing to it (`RepoTags`), as the engine spells them (Docker: familiar
    /// `ubuntu:22.04`; Podman: `docker.io/library/ubuntu:22.04`); empty for an image no name
    /// points to any more (dangling). Compare them with [`crate::normalize_reference`].
    pub tags: Vec<String>,
    /// Its size as the engine reports it (its layers, shared ones included): not what its
    /// removal frees.
    pub size: u64,
    /// The names by digest pointing to it (`RepoDigests`: `repo@sha256:…`), which Docker's
    /// classic store does not count among its tags, and which go with the image's last tag
    /// of their repository.
    pub digests: Vec<String>,
}

impl ImageDetails {
    /// The image `id`, named by `tags`, of `size` bytes.
    pub fn new(id: impl Into<String>, tags: Vec<String>, size: u64) -> Self {
        Self {
            id: id.into(),
            tags,
            size,
            digests: Vec::new(),
        }
    }

    /// The same, also named by `digests`.
    #[must_use]
    pub fn with_digests(mut self, digests: Vec<String>) -> Self {
        self.digests = digests;
        self
    }
}

/// A container's state as the runtime reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ContainerState {
    /// Created, never started.
    Created,
    /// Running.
    Running,
    /// Paused.
    Paused,
    /// Restarting.
    Restarting,
    /// Being removed.
    Removing,
    /// Exited (was started and its process ended).
    Exited,
    /// Dead (the daemon failed to stop or remove it).
    Dead,
    /// A state this crate does not know (Podman's `stopped`, `stopping`, `unknown`): one to
    /// wait on, which [`Self::is_running`] counts as alive.
    Other(String),
}

impl ContainerState {
    /// Parses Docker's state string (`created`, `running`, …).
    pub fn parse(state: &str) -> Self {
        match state {
            "created" => Self::Created,
            "running" => Self::Running,
            "paused" => Self::Paused,
            "restarting" => Self::Restarting,
            "removing" => Self::Removing,
            "exited" => Self::Exited,
            "dead" => Self::Dead,
            other => Self::Other(other.to_owned()),
        }
    }

    /// Whether the container's process is (or may still be) alive: running, paused,
    /// restarting, or a state this crate does not know ([`Self::Other`]).
    ///
    /// An unknown state is one to wait on, never an exit: Podman reports `stopping` while a
    /// stop's grace period runs, and `stopped` for a moment after an exit, before it has read
    /// the exit code (Podman 4.3: libpod/oci_conmon_common.go takes `stopped` from the OCI
    /// runtime; the exit file is read later; later Podmans map it to `exited` in their compat
    /// API, pkg/api/handlers/compat/containers.go). Reading either as exited would end a task
    /// whose process runs, or with a wrong exit code; the next look tells.
    pub fn is_running(&self) -> bool {
        matches!(
            self,
            Self::Running | Self::Paused | Self::Restarting | Self::Other(_)
        )
    }
}

impl fmt::Display for ContainerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Created => "created",
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Restarting => "restarting",
            Self::Removing => "removing",
            Self::Exited => "exited",
            Self::Dead => "dead",
            Self::Other(s) => s,
        })
    }
}

/// Whether `have` carries all of `want` (a wanted label with an empty value: the label is
/// present, whatever its value). The one meaning of a label filter in this crate: the Docker
/// runtime checks it in the shim on what the engine returns, the fake on what it holds.
pub(crate) fn has_labels(have: &BTreeMap<String, String>, want: &[(String, String)]) -> bool {
    want.iter().all(|(k, v)| match have.get(k) {
        Some(h) => v.is_empty() || h == v,
        None => false,
    })
}

/// A container port published on a host port (IPv4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PublishedPort {
    /// The port inside the container.
    pub container: u16,
    /// The host port it is published on.
    pub host: u16,
}

impl From<PublishedPort> for shim_task::PortMapping {
    fn from(p: PublishedPort) -> Self {
        Self {
            host: p.host,
            container: p.container,
        }
    }
}

/// A mount of a container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MountPoint {
    /// The host path (bind mounts) or volume path.
    pub source: String,
    /// The path inside the container.
    pub destination: String,
    /// Whether it is mounted read-write.
    pub read_write: bool,
}

/// What [`crate::ContainerRuntime::inspect`] tells about a container. Non-exhaustive (it grows
/// as the engine learns more about a container, as `pid` did): another runtime makes one with
/// [`ContainerDetails::new`] and sets the fields it knows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ContainerDetails {
    /// The full container id.
    pub id: String,
    /// The name, without Docker's leading `/`.
    pub name: String,
    /// The image reference it was created from.
    pub image: String,
    /// Its state.
    pub state: ContainerState,
    /// The exit code (meaningful once exited).
    pub exit_code: Option<i64>,
    /// The daemon's error for this container (e.g. why start failed), empty if none.
    pub error: String,
    /// Whether the kernel OOM killer ended it.
    pub oom_killed: bool,
    /// The process id of its main process on the host while it runs (`None` otherwise):
    /// where its control group is found.
    pub pid: Option<u32>,
    /// When it started (RFC 3339), `None` if never started.
    pub started_at: Option<String>,
    /// When it finished (RFC 3339), `None` if it has not finished.
    pub finished_at: Option<String>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Published ports (IPv4 bindings only), sorted.
    pub ports: Vec<PublishedPort>,
    /// Its mounts.
    pub mounts: Vec<MountPoint>,
    /// Its environment (`NAME=value`).
    pub env: Vec<String>,
    /// GPU/accelerator device requests.
    pub device_requests: Vec<DeviceRequest>,
    /// Devices mapped into it.
    pub devices: Vec<DeviceMapping>,
    /// The network mode (`host`, `bridge`, …).
    pub network_mode: String,
    /// CPU limit in nano-CPUs (0 = none).
    pub nano_cpus: i64,
    /// Memory limit in bytes (0 = none).
    pub memory: i64,
    /// Whether it is privileged.
    pub privileged: bool,
    /// The `/dev/shm` size in bytes (0 = unknown/default).
    pub shm_size: i64,
    /// The tmpfs mounts (path → options).
    pub tmpfs: BTreeMap<String, String>,
    /// The user it runs as (empty = image default).
    pub user: String,
}

impl ContainerDetails {
    /// A container `id` named `name`, made from `image`, in `state`; every other field empty
    /// (no exit code, no process, no mounts, no limits). As another runtime answers an
    /// inspect:
    ///
    /// ```
    /// use shim_runtime::{ContainerDetails, ContainerState};
    ///
    /// let mut exited = ContainerDetails::new("c1", "job-t1", "busybox:1", ContainerState::Exited);
    /// exited.exit_code = Some(3);
    /// assert_eq!((exited.exit_code, exited.pid), (Some(3), None));
    /// ```
    pub fn new(
        id: impl Into<String>,
        name: impl Into<String>,
        image: impl Into<String>,
        state: ContainerState,
    ) -> Self {
        Self {
            id: id.into(),
            name: name.into(),
            image: image.into(),
            state,
            exit_code: None,
            error: String::new(),
            oom_killed: false,
            pid: None,
            started_at: None,
            finished_at: None,
            labels: BTreeMap::new(),
            ports: Vec::new(),
            mounts: Vec::new(),
            env: Vec::new(),
            device_requests: Vec::new(),
            devices: Vec::new(),
            network_mode: String::new(),
            nano_cpus: 0,
            memory: 0,
            privileged: false,
            shm_size: 0,
            tmpfs: BTreeMap::new(),
            user: String::new(),
        }
    }
}

/// One entry of [`crate::ContainerRuntime::list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerSummary {
    /// The full container id.
    pub id: String,
    /// The name, without Docker's leading `/`.
    pub name: String,
    /// Its state.
    pub state: ContainerState,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its mounts (source and destination).
    pub mounts: Vec<MountPoint>,
    /// Published ports (IPv4 bindings only), sorted.
    pub ports: Vec<PublishedPort>,
}

/// What happened to a container, as the runtime's event stream reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// Its process ended with this code (Docker's `die`; the code may be missing).
    Die {
        /// The exit code.
        exit_code: Option<i64>,
    },
    /// The kernel's OOM killer hit it (Docker sends `oom` before `die`).
    Oom,
    /// It was removed.
    Destroy,
    /// An image lost a name, or went (Docker's image `untag`, `delete` and `prune`; Podman's
    /// `untag` and `remove`): not a container's event. `container_id` is then the image's id
    /// (as the engine names it), `name` the name removed (or the id), and the labels are
    /// empty: it is sent whatever labels were asked for. A name seen present before may be
    /// gone.
    ImageRemoved,
}

/// One container event (or an image's removal: [`EventKind::ImageRemoved`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerEvent {
    /// The container id.
    pub container_id: String,
    /// Its name, without Docker's leading `/`.
    pub name: String,
    /// What happened.
    pub kind: EventKind,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// When, in Unix nanoseconds (the daemon's clock).
    pub time_ns: i64,
}
