//! The container runtime seen by the shim: the [`ContainerRuntime`] trait, its runtime-neutral
//! types, the container spec of SPEC §6 (built by pure functions: [`build_container_spec`]), the Docker
//! implementation ([`DockerRuntime`], on bollard) and, behind the `test-support` feature, an
//! in-memory fake (`fake::FakeRuntime`) for fast tests of the layers above.
//!
//! This crate knows nothing of tasks or HTTP: the engine maps its tasks to these types. Its
//! types from `shim-task` (the pure leaf) are `PullProgress`, which a pull reports and the
//! task view shows, and `NetworkMode`, which a task asks for and a container gets: each is
//! defined once, there (and named by its one path, `shim_task::…`).
//! Foreign errors (bollard, io) are translated once, here, into [`RuntimeError`].

mod docker;
mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
mod spec;
mod time;
mod types;
mod watchdog;

use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream::BoxStream;
use shim_task::PullProgress;
use tokio_util::sync::CancellationToken;

pub use docker::{
    DEFAULT_DOCKER_HOST, DockerRuntime, POOL_IDLE_TIMEOUT, POOL_MAX_IDLE, REQUEST_TIMEOUT,
};
pub use error::RuntimeError;

/// The most bytes [`ContainerRuntime::logs_tail`] answers: the end of what the engine sent.
/// Docker splits a long line into 16 KiB entries, but Podman answers a line whole, and the
/// log may hold a single line of its whole size (100 MiB by default).
pub const LOGS_TAIL_MAX_BYTES: usize = 64 * 1024;
pub use spec::{
    BindMount, CDI_DRIVER, ContainerInputs, ContainerSpec, DEFAULT_CDI_SPEC_DIRS, DeviceMapping,
    DeviceRequest, EXIT_NO_PACKAGE_MANAGER, EXIT_SSHD_INSTALL_FAILED, GpuConfig, HUGEPAGES_1G_PATH,
    HostDevices, INFINIBAND_PATH, LogLimits, NVIDIA_CAPABILITIES, RUNNER_BINARY_IN_CONTAINER,
    RUNNER_DIR_IN_CONTAINER, RunnerParams, Ulimit, build_container_spec, nano_cpus,
    normalize_reference, runner_script, shell_quote, with_default_tag, without_nvidia_display,
};
pub use time::docker_time_ns;
pub use types::{
    ContainerDetails, ContainerEvent, ContainerState, ContainerSummary, DiskProbe, EventKind,
    GpuSupport, ImageDetails, MountPoint, PublishedPort, PullRequest, RegistryAuth,
};
pub use watchdog::{EXTRACTION_GROWTH_MIN, EXTRACTION_POLL, EXTRACTION_STALL_TIMEOUT};

/// The result type of this crate.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// A stream of container events (see [`ContainerRuntime::events`]).
pub type EventStream = BoxStream<'static, Result<ContainerEvent>>;

/// A callback receiving the folded pull progress after every progress message.
pub type ProgressFn<'a> = &'a (dyn Fn(PullProgress) + Send + Sync);

/// A container runtime: what the engine needs of Docker, and nothing more.
///
/// Object safe; used as `Arc<dyn ContainerRuntime>`. Every method translates the runtime's own
/// errors into [`RuntimeError`], naming the container or image concerned.
#[async_trait]
pub trait ContainerRuntime: Send + Sync {
    /// Whether `image` (a full reference, e.g. `repo/name:tag`) is present locally.
    async fn image_present(&self, image: &str) -> Result<bool>;

    /// Pulls an image, calling `progress` with the folded per-layer progress as it changes,
    /// writing the daemon's progress messages as JSON lines to `request.log_path` (if any),
    /// giving up after `request.timeout` ([`RuntimeError::PullTimeout`]) or once the engine
    /// sends nothing for `request.stall_timeout` ([`RuntimeError::PullStalled`]; once every
    /// layer is downloaded, a silence while `request.disk` moves is unpacking, not a stall,
    /// and without a probe the silence may last [`EXTRACTION_STALL_TIMEOUT`]), and returning promptly
    /// with [`RuntimeError::Cancelled`] once `cancel` fires. Returns the final progress (with
    /// `is_total_bytes_final` set).
    async fn pull(
        &self,
        request: &PullRequest,
        progress: ProgressFn<'_>,
        cancel: CancellationToken,
    ) -> Result<PullProgress>;

    /// Creates a container; returns its id. A name already in use is
    /// [`RuntimeError::Conflict`]; a missing image is [`RuntimeError::NotFound`].
    /// [`DockerRuntime`] creates nothing where the engine would not honour the spec: a missing
    /// bind source ([`RuntimeError::BindSourceMissing`]: looked at before asking Podman, which
    /// would make a directory there, and after Docker refused the create), device requests
    /// the engine ignores ([`RuntimeError::DeviceRequestsIgnored`], before asking it).
    async fn create(&self, spec: &ContainerSpec) -> Result<String>;

    /// Starts a created container. The error message of a failed start is the daemon's own
    /// (see [`spec::without_nvidia_display`] for the one retry the engine makes).
    async fn start(&self, id: &str) -> Result<()>;

    /// Inspects a container by id or name.
    async fn inspect(&self, id_or_name: &str) -> Result<ContainerDetails>;

    /// Lists the containers (in every state) carrying all of `labels`, in one request. A label
    /// with an empty value matches any value (the label is present). The labels are checked
    /// by the shim on the engine's answer (engines differ in how they combine label filters).
    async fn list(&self, labels: &[(String, String)]) -> Result<Vec<ContainerSummary>>;

    /// Stops a container: SIGTERM, then SIGKILL after `timeout` (zero kills at once). A
    /// container that is already stopped is success.
    async fn stop(&self, id: &str, timeout: Duration) -> Result<()>;

    /// Force-removes a container (and its anonymous volumes). An unknown container is success.
    async fn remove(&self, id: &str) -> Result<()>;

    /// The last `n` lines of a container's log, stdout and stderr interleaved as the runtime
    /// returns them, without trailing newlines; at most [`LOGS_TAIL_MAX_BYTES`] of them in
    /// all, the last ones (one line may be a whole log: a task that never printed a newline).
    async fn logs_tail(&self, id: &str, n: usize) -> Result<Vec<String>>;

    /// A local image by name or id: its id, the names pointing to it and its size as the
    /// engine reports them, or `None` when it is not present.
    async fn inspect_image(&self, image: &str) -> Result<Option<ImageDetails>>;

    /// Removes a local image by name (that name; the image's layers when no other name holds
    /// them) or by id (an image no name points to), never by force: an image a container
    /// uses is [`RuntimeError::Conflict`], a missing one is success. What the disk got back
    /// is not said: measure it.
    async fn delete_image(&self, image: &str) -> Result<()>;

    /// What the engine can do with GPUs, as it says itself: its name and version, whether and
    /// from where it applies CDI specs, whether it applies NVIDIA device requests. Asked of
    /// the engine each time (the engine behind the socket may have been upgraded): callers
    /// keep the answer as long as they trust it.
    async fn gpu_support(&self) -> Result<GpuSupport>;

    /// The directory the engine keeps its data in (Docker's `DockerRootDir`, Podman's graph
    /// root), if it names one: the file system images fill.
    async fn data_root(&self) -> Result<Option<std::path::PathBuf>>;

    /// Subscribes to the `die`, `oom` and `destroy` events (Podman's `died` and `remove`
    /// alike) of containers carrying all of `labels` (an empty value: the label is present;
    /// checked by the shim, not left to the engine), from `since_ns` (Unix nanoseconds, that
    /// instant included on every engine; the runtime replays what it still remembers of the
    /// events since then) or from now on.
    /// The stream ends or errs when the connection is lost; events the runtime dropped are
    /// not in it, so a subscriber relists after every (re)connection.
    async fn events(
        &self,
        labels: &[(String, String)],
        since_ns: Option<i64>,
    ) -> Result<EventStream>;
}

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
