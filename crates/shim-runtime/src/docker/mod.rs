//! The Docker implementation of [`ContainerRuntime`], on bollard: the calls here, the
//! conversions between bollard's models and this crate's types in [`convert`], the folding of
//! pull progress and the pull log in [`progress`].

mod convert;
mod progress;
#[cfg(test)]
mod tests;
pub(crate) mod transport;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bollard::Docker;
use bollard::auth::DockerCredentials;
use bollard::errors::Error as BollardError;
use bollard::models::{CreateImageInfo, EventMessage, SystemVersion};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, EventsOptionsBuilder,
    ListContainersOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
    StopContainerOptionsBuilder,
};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::spec::ContainerSpec;
use crate::types::{
    ContainerDetails, ContainerSummary, GpuSupport, ImageDetails, PullRequest, has_labels,
};
use crate::watchdog::{DiskWatch, Watchdog};
use crate::{ContainerRuntime, EventStream, ProgressFn, Result, RuntimeError};
use shim_task::PullProgress;

use convert::{
    container_event, create_body, details, details_from_json, event_filters, list_prefilter,
    shadowed_exit_labels, since_param, summaries_from_json, summary,
};
use progress::{Activity, ProgressFolder, PullLog};

/// How long any request may wait for the daemon's answer to begin (streams then run on).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long an image's removal may take (its layers' files are deleted before the answer).
pub const IMAGE_DELETE_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// How long a pull's answer may take to begin, as bollard counts it: Docker sends the answer's
/// head with its first progress message, which comes only once the registry has answered (a
/// slow token server, an unreachable mirror's 30 s dial before the fallback). The pull's own
/// stall timeout and time limit bound that wait instead ([`Watchdog`]).
const PULL_ANSWER_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);
/// How many image names [`DockerRuntime`] keeps what it learnt of their labels for.
const KNOWN_IMAGES_MAX: usize = 1024;
/// The daemon's address when `DOCKER_HOST` is not set.
pub const DEFAULT_DOCKER_HOST: &str = "unix:///var/run/docker.sock";
pub use transport::{POOL_IDLE_TIMEOUT, POOL_MAX_IDLE};

/// The [`ContainerRuntime`] backed by a Docker daemon.
#[derive(Debug, Clone)]
pub struct DockerRuntime {
    docker: Docker,
    /// The engine behind the socket (`GET /version`): read at [`DockerRuntime::connect`],
    /// or for a runtime made by [`DockerRuntime::unconnected`], by
    /// [`DockerRuntime::identify`] or the first request that needs it; read again by every
    /// [`ContainerRuntime::gpu_support`] (asked again after the event stream was lost: the
    /// daemon may have come back another version).
    flavour: Arc<std::sync::Mutex<Option<Arc<Flavour>>>>,
    /// Per image name (as the shim names it), the exit-code attributes its labels would
    /// overwrite in a `die` event ([`convert::shadowed_exit_labels`]): learnt from every image
    /// inspect, looked at by a create on Docker.
    shadowed: Arc<std::sync::Mutex<HashMap<String, Vec<String>>>>,
}

/// The engine behind the Docker API, as its version answer (`GET /version`) names it: Podman
/// lists a component "Podman Engine" (pkg/api/handlers/compat/version.go); Docker does not.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Flavour {
    Docker,
    /// Podman, with its own version (`5.4.2`), not the API version it speaks.
    Podman {
        version: String,
    },
}

impl Flavour {
    fn of(answer: &SystemVersion) -> Self {
        answer
            .components
            .iter()
            .flatten()
            .find(|c| c.name.starts_with("Podman"))
            .map_or(Self::Docker, |c| Self::Podman {
                version: c.version.clone(),
            })
    }

    /// Checks that this engine honours every device request of `spec`: Podman's Docker API
    /// ignores them (5.x all but the `cdi` driver's, 4.3 all of them: a Podman before 5 is
    /// taken to honour none), and a container created anyway would run without its GPUs. So a spec with such a request is
    /// [`RuntimeError::DeviceRequestsIgnored`] and nothing is created. Plain device mappings
    /// (AMD, Tenstorrent, InfiniBand) are honoured on every engine and not looked at.
    fn check_device_requests(&self, spec: &ContainerSpec) -> Result<()> {
        let Self::Podman { version } = self else {
            return Ok(());
        };
        match podman_ignored_request(version, spec) {
            Some(request) => Err(RuntimeError::DeviceRequestsIgnored {
                what: container(&spec.name),
                engine: format!("Podman {version}"),
                driver: request.driver.clone(),
            }),
            None => Ok(()),
        }
    }

    /// What the engine can do with GPUs (see [`GpuSupport`]): Docker says where it reads CDI
    /// specs in `/info` (nothing before 25, an empty list while CDI is off); Podman 5.4+
    /// applies CDI requests from its default spec dirs, earlier Podman none.
    async fn gpu_support(&self, docker: &Docker) -> Result<GpuSupport> {
        match self {
            Self::Podman { version } => {
                let cdi = podman_applies_cdi(version).then(|| {
                    crate::DEFAULT_CDI_SPEC_DIRS
                        .iter()
                        .map(PathBuf::from)
                        .collect()
                });
                Ok(GpuSupport::new(format!("Podman {version}"), cdi, false))
            }
            Self::Docker => {
                let info = docker
                    .info()
                    .await
                    .map_err(|e| translate("info", "the daemon".to_owned(), e))?;
                let cdi = info
                    .cdi_spec_dirs
                    .filter(|dirs| !dirs.is_empty())
                    .map(|dirs| dirs.into_iter().map(PathBuf::from).collect());
                let version = info.server_version.unwrap_or_default();
                Ok(GpuSupport::new(format!("Docker {version}"), cdi, true))
            }
        }
    }
}

/// Whether Podman `version` applies CDI device requests through its Docker API: from 5.4
/// (its compat create reads `HostConfig.DeviceRequests` from then on); 4.x and 5.0 to 5.3
/// ignore every device request, so a GPU task would run without its GPUs.
pub(crate) fn podman_applies_cdi(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let (major, minor) = (parts.next().flatten(), parts.next().flatten());
    major.zip(minor).is_some_and(|v| v >= (5, 4))
}

/// The first device request of `spec` that Podman `version`'s Docker API would ignore: all
/// but the `cdi` driver's on 5.x, every one on 4.
pub(crate) fn podman_ignored_request<'a>(
    version: &str,
    spec: &'a ContainerSpec,
) -> Option<&'a crate::DeviceRequest> {
    let cdi = podman_applies_cdi(version);
    spec.device_requests
        .iter()
        .find(|r| !(cdi && r.driver == crate::CDI_DRIVER))
}

/// Translates a bollard error into a [`RuntimeError`], once.
fn translate(op: &'static str, what: String, err: BollardError) -> RuntimeError {
    match err {
        BollardError::DockerResponseServerError {
            status_code: 404,
            message,
        } => {
            debug!(op, %what, %message, "not found");
            RuntimeError::NotFound { what }
        }
        BollardError::DockerResponseServerError {
            status_code: 409,
            message,
        } => RuntimeError::Conflict { op, what, message },
        BollardError::DockerResponseServerError {
            status_code,
            message,
        } => RuntimeError::Daemon {
            op,
            what,
            status: status_code,
            message,
        },
        // The answer could not be read. Its text (bollard's `json_data_content`, kept for the
        // readings of `details_from_json` and `summaries_from_json`) is dropped here: an
        // inspect answer carries the container's environment, which no log may show.
        BollardError::JsonDataError {
            message, column, ..
        } => malformed(op, what, &message, column),
        err @ (BollardError::SocketNotFoundError(_)
        | BollardError::HyperLegacyError { .. }
        | BollardError::HyperResponseError { .. }
        | BollardError::IOError { .. }
        | BollardError::RequestTimeoutError) => RuntimeError::DaemonUnavailable {
            op,
            what,
            source: Box::new(err),
        },
        err => RuntimeError::Other {
            op,
            what,
            source: Box::new(err),
        },
    }
}

/// An answer that could not be read (its text is not kept: see [`translate`]).
fn malformed(op: &'static str, what: String, message: &str, column: usize) -> RuntimeError {
    RuntimeError::Other {
        op,
        what,
        source: format!("malformed answer at column {column}: {message}").into(),
    }
}

fn container(id: &str) -> String {
    format!("container {id}")
}

/// Checks that every bind source of `spec` exists (following links, as the engine does): a
/// missing one is [`RuntimeError::BindSourceMissing`]. SPEC §6's rule (a missing runner
/// binary touches nothing) holds on both engines: Podman creates an empty directory at a
/// missing source, so there this runs before the engine is asked; Docker refuses such a
/// create (`Mounts` of type `bind`, every API version: `bind source path does not exist`)
/// and creates nothing, so there it runs only after a refused create, to name the cause, and
/// a start costs no trip to the blocking pool for it (an engine that does not name itself
/// Podman in `/version` is taken for Docker, here as for events and GPUs; every engine CI
/// runs passes the real-engine test of it). A lookup that fails otherwise (a
/// permission the shim lacks) is left for the engine to judge. All the lookups go to the
/// blocking pool at once (one hop, not one a mount).
async fn check_bind_sources(spec: &ContainerSpec) -> Result<()> {
    if spec.mounts.is_empty() {
        return Ok(());
    }
    let sources: Vec<PathBuf> = spec.mounts.iter().map(|m| m.source.clone()).collect();
    let name = spec.name.clone();
    let looked = tokio::task::spawn_blocking(move || {
        for source in sources {
            // `Path::metadata`, not `fs_err`'s: the error (`BindSourceMissing`) names the path
            // itself, so the OS's words stand alone in the task's termination message.
            match source.metadata() {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                    ) =>
                {
                    return Err((source, e));
                }
                Err(err) => {
                    debug!(container = %name, source = %source.display(), %err, "cannot look at a bind source; the engine decides");
                }
            }
        }
        Ok(())
    })
    .await;
    match looked {
        Ok(Ok(())) => Ok(()),
        Ok(Err((path, source))) => Err(RuntimeError::BindSourceMissing {
            what: container(&spec.name),
            path,
            source,
        }),
        // The lookups panicked or the runtime is shutting down: the engine decides.
        Err(err) => {
            debug!(container = %spec.name, %err, "cannot look at the bind sources; the engine decides");
            Ok(())
        }
    }
}

impl DockerRuntime {
    /// Connects through `DOCKER_HOST` or the default socket (`unix:///var/run/docker.sock`)
    /// and reads which engine answers (one `/version` request).
    pub async fn connect() -> Result<Self> {
        let runtime = Self::unconnected()?;
        runtime.identify().await?;
        Ok(runtime)
    }

    /// A runtime for `DOCKER_HOST` or the default socket that has sent nothing yet: its first
    /// requests may go out at once, side by side with [`DockerRuntime::identify`] (a restart's
    /// start-up list need not wait for the `/version` round trip). Fails only on an address
    /// it cannot use.
    pub fn unconnected() -> Result<Self> {
        let host = std::env::var("DOCKER_HOST").unwrap_or_else(|_| DEFAULT_DOCKER_HOST.to_owned());
        Self::client_for(&host).map(Self::wrap)
    }

    /// Reads which engine answers (one `GET /version`, once): the error says the daemon is not
    /// there.
    pub async fn identify(&self) -> Result<()> {
        self.flavour().await.map(|_| ())
    }

    /// The engine behind the socket, as last read (read now if never).
    async fn flavour(&self) -> Result<Arc<Flavour>> {
        let known = self
            .flavour
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match known {
            Some(flavour) => Ok(flavour),
            None => self.read_flavour().await,
        }
    }

    /// Reads which engine answers now (one `GET /version`), and keeps it.
    async fn read_flavour(&self) -> Result<Arc<Flavour>> {
        let answer = self
            .docker
            .version()
            .await
            .map_err(|e| translate("version", "docker daemon".to_owned(), e))?;
        let flavour = Arc::new(Flavour::of(&answer));
        let before = self
            .flavour
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(flavour.clone());
        match before {
            Some(before) if before != flavour => {
                info!(?before, now = ?flavour, "the engine behind the socket changed");
            }
            Some(_) => {}
            None => debug!(?flavour, api = ?answer.api_version, "connected to the engine"),
        }
        Ok(flavour)
    }

    /// Connects to `host` (`unix:///path`, `tcp://…`, as in `DOCKER_HOST`) and reads which
    /// engine answers. Over a Unix socket the connections are kept alive and reused (a pool of
    /// at most [`POOL_MAX_IDLE`] idle ones, see [`DockerRuntime::connect_unix`]).
    pub async fn connect_to(host: &str) -> Result<Self> {
        let runtime = Self::wrap(Self::client_for(host)?);
        runtime.identify().await?;
        Ok(runtime)
    }

    /// The client for `host`; sends nothing.
    fn client_for(host: &str) -> Result<Docker> {
        match transport::unix_socket_of(host) {
            Some(path) => Self::unix_client(&path, POOL_MAX_IDLE),
            None => Docker::connect_with_host(host)
                .map_err(|e| translate("connect", format!("docker daemon at {host}"), e)),
        }
    }

    fn unix_client(path: &std::path::Path, max_idle: usize) -> Result<Docker> {
        transport::pooled_unix(path, max_idle, POOL_IDLE_TIMEOUT, REQUEST_TIMEOUT)
            .map_err(|e| translate("connect", format!("docker daemon at {}", path.display()), e))
    }

    /// Connects to the daemon's Unix socket at `path`, keeping at most `max_idle` idle
    /// connections for reuse (each closed after [`POOL_IDLE_TIMEOUT`]); `max_idle` 0 opens a
    /// new connection per request, as bollard's `connect_with_unix` does (benchmarks compare
    /// the two).
    pub async fn connect_unix(path: &std::path::Path, max_idle: usize) -> Result<Self> {
        Self::from_client(Self::unix_client(path, max_idle)?).await
    }

    /// Wraps a bollard client, reading which engine answers
    /// (Docker or Podman: see `Flavour`). Every request gets at most `REQUEST_TIMEOUT` (30 s)
    /// for its response to begin (a frozen daemon does not hang the shim); a stop gets its
    /// grace period on top.
    pub async fn from_client(docker: Docker) -> Result<Self> {
        // No version negotiation: bollard's request paths are absolute and replace the
        // `/v1.xx` prefix its URIs are built with (`uri.rs`: `url.join(path)`), so every
        // request is unversioned and the daemon answers in its own API version whatever the
        // client's is. Negotiating would only cost a second `/version` round trip (4 ms on
        // Docker 28's containerd store) before the start-up list.
        let runtime = Self::wrap(docker);
        runtime.identify().await?;
        Ok(runtime)
    }

    /// A runtime on `docker` whose engine is not read yet; every request gets at most
    /// `REQUEST_TIMEOUT`.
    fn wrap(docker: Docker) -> Self {
        Self {
            docker: docker.with_timeout(REQUEST_TIMEOUT),
            flavour: Arc::default(),
            shadowed: Arc::default(),
        }
    }

    /// Notes which exit-code attributes the labels of `image` (`details`, just inspected)
    /// would overwrite.
    fn learn_labels(&self, image: &str, details: &bollard::models::ImageInspect) {
        let labels = details.config.as_ref().and_then(|c| c.labels.as_ref());
        let shadowed = shadowed_exit_labels(labels);
        let mut known = self.shadowed.lock().unwrap_or_else(|p| p.into_inner());
        // Names of images seen: a bound for a shim that runs for years (forgetting costs one
        // inspect at the next create).
        if known.len() >= KNOWN_IMAGES_MAX && !known.contains_key(image) {
            known.clear();
        }
        known.insert(image.to_owned(), shadowed);
    }

    /// Docker copies a container's labels into its `die` event after the exit code, so an
    /// image labelled `exitCode` (which the container inherits) would name the exit code of
    /// every task made of it (`LABEL exitCode=0`: a failed task read as done). Such labels are
    /// set empty in the create (a create's label wins over the image's), so the event carries
    /// no number and the engine inspects the container for its code. Images are known from
    /// the inspects before a create (the pull step's, see [`Self::learn_labels`]); one never
    /// inspected is inspected here.
    async fn shadow_exit_labels(
        &self,
        image: &str,
        body: &mut bollard::models::ContainerCreateBody,
    ) {
        let known = self
            .shadowed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(image)
            .cloned();
        let shadowed = match known {
            Some(shadowed) => shadowed,
            None => match self.docker.inspect_image(image).await {
                Ok(details) => {
                    self.learn_labels(image, &details);
                    shadowed_exit_labels(details.config.as_ref().and_then(|c| c.labels.as_ref()))
                }
                // The create says what is wrong with the image.
                Err(_) => Vec::new(),
            },
        };
        let labels = body.labels.get_or_insert_with(HashMap::new);
        for key in shadowed {
            labels.insert(key, String::new());
        }
    }

    /// This runtime with every request's answer awaited at most `timeout` (whole seconds;
    /// [`REQUEST_TIMEOUT`] by default) before it counts as lost. A pull's answer is the
    /// exception: its stall timeout bounds it.
    #[must_use]
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.docker = self.docker.with_timeout(timeout);
        self
    }

    /// The underlying bollard client (for tests that prepare the daemon).
    pub fn client(&self) -> &Docker {
        &self.docker
    }

    /// A failed create's error, of the same kind on every engine: a 404 is the image missing
    /// ([`RuntimeError::NotFound`] naming it); a name in use is [`RuntimeError::Conflict`].
    /// Docker answers a name in use with 409; Podman with 500 (its compat API maps every
    /// create failure but a missing image to 500: pkg/api/handlers/compat/containers_create.go,
    /// 4.3 and 5.x), so a create the engine refuses otherwise while a container of that name
    /// exists is a conflict too, told by an inspect of the name rather than by the message.
    async fn create_error(&self, spec: &ContainerSpec, err: BollardError) -> RuntimeError {
        match translate("create", container(&spec.name), err) {
            RuntimeError::NotFound { .. } => RuntimeError::NotFound {
                what: format!("image {}", spec.image),
            },
            RuntimeError::Daemon {
                op,
                what,
                status,
                message,
            } => match self.inspect(&spec.name).await {
                Ok(existing) => {
                    debug!(container = %spec.name, existing = %existing.id, status, "create refused while the name is in use: a conflict");
                    RuntimeError::Conflict { op, what, message }
                }
                Err(_) => RuntimeError::Daemon {
                    op,
                    what,
                    status,
                    message,
                },
            },
            other => other,
        }
    }

    async fn pull_stream(
        &self,
        request: &PullRequest,
        image: &str,
        folder: &mut ProgressFolder,
        progress: ProgressFn<'_>,
        log: &mut Option<PullLog>,
    ) -> Result<()> {
        let mut watchdog = Watchdog::new(request.stall_timeout);
        let mut disk = DiskWatch::new(request.disk.clone(), request.stall_timeout);
        // Without a disk to watch, the silence after the last download may be unpacking for
        // up to this long.
        let silent_limit = match &disk {
            Some(_) => watchdog.limit(),
            None => watchdog.limit_at_least(crate::EXTRACTION_STALL_TIMEOUT),
        };
        let mut activity = Activity::default();
        let options = CreateImageOptionsBuilder::new().from_image(image).build();
        let credentials = request.auth.as_ref().map(|a| DockerCredentials {
            username: Some(a.username.clone()),
            password: Some(a.password.clone()),
            ..DockerCredentials::default()
        });
        let docker = self.docker.clone().with_timeout(PULL_ANSWER_TIMEOUT);
        let mut stream = docker.create_image(Some(options), None, credentials);
        loop {
            // The watchdog fails the pull when no message says anything new for the stall
            // timeout (repeats are not progress: see `Activity`).
            let unpacking = folder.downloads_complete();
            let limit = if unpacking {
                silent_limit
            } else {
                watchdog.limit()
            };
            let next = tokio::select! {
                item = stream.next() => Ok(item),
                moved = async {
                    match disk.as_mut() {
                        Some(disk) => disk.moved().await,
                        None => std::future::pending().await,
                    }
                }, if unpacking => {
                    if moved {
                        debug!(%image, "the engine's data on disk moved while it unpacks");
                        watchdog.moved();
                    }
                    continue;
                }
                stalled = watchdog.stalled(limit) => Err(stalled),
            };
            let item = match next {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(stalled_for) => {
                    let p = folder.progress(false);
                    let elapsed = watchdog.elapsed();
                    warn!(%image, ?stalled_for, done_bytes = p.downloaded_bytes, total_bytes = p.total_bytes, "pull stalled: the engine sent nothing");
                    return Err(RuntimeError::PullStalled {
                        image: image.to_owned(),
                        stalled_for,
                        done_bytes: p.downloaded_bytes,
                        total_bytes: p.total_bytes,
                        total_known: p.is_total_bytes_final,
                        elapsed,
                        rate: crate::watchdog::rate(p.downloaded_bytes, elapsed),
                    });
                }
            };
            match item {
                Ok(info) => {
                    // The engine's repeats (Docker 28's containerd store says each layer's
                    // last line again every 100 ms) are neither activity nor logged.
                    if activity.is_new(&info) {
                        watchdog.moved();
                        if let Some(log) = log.as_mut() {
                            log.write(&info).await?;
                        }
                    }
                    if folder.feed(&info) {
                        progress(folder.progress(false));
                    }
                }
                Err(BollardError::DockerStreamError { error }) => {
                    return Err(RuntimeError::PullFailed {
                        image: image.to_owned(),
                        message: error,
                        downloaded_bytes: folder.progress(false).downloaded_bytes,
                    });
                }
                Err(BollardError::DockerResponseServerError {
                    message,
                    status_code,
                }) if status_code != 500 || !message.is_empty() => {
                    if let Some(log) = log.as_mut() {
                        let line = CreateImageInfo {
                            error_detail: Some(bollard::models::ErrorDetail {
                                code: Some(i64::from(status_code)),
                                message: Some(message.clone()),
                            }),
                            ..CreateImageInfo::default()
                        };
                        log.write(&line).await?;
                    }
                    return Err(RuntimeError::PullFailed {
                        image: image.to_owned(),
                        message,
                        downloaded_bytes: folder.progress(false).downloaded_bytes,
                    });
                }
                Err(err) => return Err(translate("pull", format!("image {image}"), err)),
            }
        }
        Ok(())
    }
}

#[async_trait]
impl ContainerRuntime for DockerRuntime {
    async fn image_present(&self, image: &str) -> Result<bool> {
        match self.docker.inspect_image(image).await {
            Ok(details) => {
                self.learn_labels(image, &details);
                Ok(true)
            }
            Err(err) => match translate("inspect image", format!("image {image}"), err) {
                RuntimeError::NotFound { .. } => Ok(false),
                other => Err(other),
            },
        }
    }

    async fn inspect_image(&self, image: &str) -> Result<Option<ImageDetails>> {
        match self.docker.inspect_image(image).await {
            Ok(details) => {
                self.learn_labels(image, &details);
                // Docker 20.10's classic store names a dangling image `<none>:<none>` (and
                // `<none>@<none>`).
                let named = |names: Option<Vec<String>>| -> Vec<String> {
                    (names.unwrap_or_default().into_iter())
                        .filter(|t| !t.starts_with("<none>"))
                        .collect()
                };
                let id = details.id.clone().unwrap_or_default();
                let size = (details.size.and_then(|s| u64::try_from(s).ok())).unwrap_or(0);
                Ok(Some(
                    ImageDetails::new(id, named(details.repo_tags), size)
                        .with_digests(named(details.repo_digests)),
                ))
            }
            Err(err) => match translate("inspect image", format!("image {image}"), err) {
                RuntimeError::NotFound { .. } => Ok(None),
                other => Err(other),
            },
        }
    }

    async fn delete_image(&self, image: &str) -> Result<()> {
        let options = bollard::query_parameters::RemoveImageOptionsBuilder::default()
            .force(false)
            .noprune(false)
            .build();
        // The classic store answers once the layers' files are gone: minutes for a large
        // image on a slow disk. Cut at 30 s, a removal still under way read as failed, and a
        // collection went on removing more than it needed.
        let docker = self.docker.clone().with_timeout(IMAGE_DELETE_TIMEOUT);
        match docker.remove_image(image, Some(options), None).await {
            Ok(_) => Ok(()),
            Err(err) => match translate("remove image", format!("image {image}"), err) {
                RuntimeError::NotFound { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn gpu_support(&self) -> Result<GpuSupport> {
        self.read_flavour().await?.gpu_support(&self.docker).await
    }

    async fn data_root(&self) -> Result<Option<std::path::PathBuf>> {
        let info = self
            .docker
            .info()
            .await
            .map_err(|e| translate("info", "the daemon".to_owned(), e))?;
        Ok(info
            .docker_root_dir
            .filter(|d| !d.is_empty())
            .map(std::path::PathBuf::from))
    }

    async fn pull(
        &self,
        request: &PullRequest,
        progress: ProgressFn<'_>,
        cancel: CancellationToken,
    ) -> Result<PullProgress> {
        let image = crate::spec::with_default_tag(&request.image);
        let mut log = match &request.log_path {
            Some(path) => Some(PullLog::create(path).await?),
            None => None,
        };
        debug!(%image, with_auth = request.auth.is_some(), "pulling image");
        let mut folder = ProgressFolder::default();
        // Dropping the pull future drops the response stream and its connection: the daemon
        // then abandons the pull.
        let outcome = tokio::select! {
            biased;
            () = cancel.cancelled() => Err(RuntimeError::Cancelled {
                op: "pull",
                what: format!("image {image}"),
            }),
            () = crate::watchdog::expiry(request.timeout) => Err(RuntimeError::PullTimeout {
                image: image.clone(),
                timeout: request.timeout.unwrap_or_default(),
                downloaded_bytes: 0,
            }),
            r = self.pull_stream(request, &image, &mut folder, progress, &mut log) => r,
        };
        if let Some(log) = log {
            log.finish().await;
        }
        match outcome {
            Ok(()) => {
                let done = folder.progress(true);
                progress(done);
                Ok(done)
            }
            Err(RuntimeError::PullTimeout { image, timeout, .. }) => {
                Err(RuntimeError::PullTimeout {
                    image,
                    timeout,
                    downloaded_bytes: folder.progress(false).downloaded_bytes,
                })
            }
            Err(err) => Err(err),
        }
    }

    async fn create(&self, spec: &ContainerSpec) -> Result<String> {
        let flavour = self.flavour().await?;
        flavour.check_device_requests(spec)?;
        // Podman would make a directory at a missing source: looked at first. Docker refuses
        // such a create: looked at only when a create was refused.
        let podman = matches!(*flavour, Flavour::Podman { .. });
        if podman {
            check_bind_sources(spec).await?;
        }
        let options = CreateContainerOptionsBuilder::new()
            .name(&spec.name)
            .build();
        let mut body = create_body(spec);
        if podman {
            // Podman limits a container to 2,048 processes unless told otherwise (its
            // `pids_limit` default); Docker, as upstream's shim runs there, to none. A task
            // with many workers and threads (Ray, DataLoader workers) would fail to fork.
            if let Some(host) = body.host_config.as_mut() {
                host.pids_limit.get_or_insert(-1);
            }
        } else {
            self.shadow_exit_labels(&spec.image, &mut body).await;
        }
        let resp = match self.docker.create_container(Some(options), body).await {
            Ok(resp) => resp,
            Err(err) => {
                let err = self.create_error(spec, err).await;
                if !podman && matches!(err, RuntimeError::Daemon { .. }) {
                    check_bind_sources(spec).await?;
                }
                return Err(err);
            }
        };
        for warning in &resp.warnings {
            warn!(container = %spec.name, %warning, "docker warning on create");
        }
        Ok(resp.id)
    }

    async fn start(&self, id: &str) -> Result<()> {
        self.docker
            .start_container(id, None::<bollard::query_parameters::StartContainerOptions>)
            .await
            .map_err(|e| translate("start", container(id), e))
    }

    async fn inspect(&self, id_or_name: &str) -> Result<ContainerDetails> {
        let answer = self
            .docker
            .inspect_container(
                id_or_name,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await;
        match answer {
            Ok(resp) => Ok(details(resp)),
            // A state bollard does not know (Podman's `stopped`): read without bollard's enum.
            Err(BollardError::JsonDataError {
                message,
                column,
                contents,
            }) => details_from_json(&contents)
                .map_err(|_| malformed("inspect", container(id_or_name), &message, column)),
            Err(err) => Err(translate("inspect", container(id_or_name), err)),
        }
    }

    async fn list(&self, labels: &[(String, String)]) -> Result<Vec<ContainerSummary>> {
        // The engine's filter narrows only (see `list_prefilter`); the labels are checked here.
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&list_prefilter(labels))
            .build();
        let containers = match self.docker.list_containers(Some(options)).await {
            Ok(containers) => containers.into_iter().map(summary).collect(),
            // A state bollard does not know, of any container: read without bollard's enum.
            Err(BollardError::JsonDataError {
                message,
                column,
                contents,
            }) => summaries_from_json(&contents)
                .map_err(|_| malformed("list", "containers".to_owned(), &message, column))?,
            Err(err) => return Err(translate("list", "containers".to_owned(), err)),
        };
        Ok(containers
            .into_iter()
            .filter(|c: &ContainerSummary| has_labels(&c.labels, labels))
            .collect())
    }

    async fn stop(&self, id: &str, timeout: Duration) -> Result<()> {
        let secs = i32::try_from(timeout.as_secs()).unwrap_or(i32::MAX);
        let options = StopContainerOptionsBuilder::new().t(secs).build();
        // The request lasts as long as the grace period: give the client more than that.
        let docker = self
            .docker
            .clone()
            .with_timeout(timeout.saturating_add(Duration::from_secs(60)));
        match docker.stop_container(id, Some(options)).await {
            Ok(()) => Ok(()),
            // 304: already stopped.
            Err(BollardError::DockerResponseServerError {
                status_code: 304, ..
            }) => Ok(()),
            Err(err) => Err(translate("stop", container(id), err)),
        }
    }

    async fn remove(&self, id: &str) -> Result<()> {
        let options = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        match self.docker.remove_container(id, Some(options)).await {
            Ok(()) => Ok(()),
            Err(err) => match translate("remove", container(id), err) {
                RuntimeError::NotFound { .. } => Ok(()),
                // Removal already in progress: it will be gone.
                RuntimeError::Conflict { message, .. }
                    if message.contains("already in progress") =>
                {
                    Ok(())
                }
                other => Err(other),
            },
        }
    }

    async fn logs_tail(&self, id: &str, n: usize) -> Result<Vec<String>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let options = LogsOptionsBuilder::new()
            .stdout(true)
            .stderr(true)
            .follow(false)
            .tail(&n.to_string())
            .build();
        // Only the end is kept while the answer streams in (see `LOGS_TAIL_MAX_BYTES`).
        let max = crate::LOGS_TAIL_MAX_BYTES;
        let mut stream = self.docker.logs(id, Some(options));
        let mut bytes: Vec<u8> = Vec::new();
        // The whole answer bounded, not only its head: Docker 26+ sends the head before it
        // reads the log, so a read that stalls (a hung data root) would hold the caller (an
        // exit's settlement, the reconciler's cycle) for good.
        let read = tokio::time::timeout(self.docker.timeout(), async {
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| translate("logs", container(id), e))?;
                bytes.extend_from_slice(&chunk.into_bytes());
                if bytes.len() > 2 * max {
                    bytes.drain(..bytes.len() - max);
                }
            }
            Ok::<(), RuntimeError>(())
        })
        .await;
        match read {
            Ok(read) => read?,
            Err(_) => {
                return Err(translate(
                    "logs",
                    container(id),
                    BollardError::RequestTimeoutError,
                ));
            }
        }
        if bytes.len() > max {
            bytes.drain(..bytes.len() - max);
        }
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<String> = text
            .split('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l).to_owned())
            .collect();
        // A trailing newline leaves an empty last element.
        let lines: Vec<String> = match lines.split_last() {
            Some((last, rest)) if last.is_empty() => rest.to_vec(),
            _ => lines,
        };
        let skip = lines.len().saturating_sub(n);
        Ok(lines[skip..].to_vec())
    }

    async fn events(
        &self,
        labels: &[(String, String)],
        since_ns: Option<i64>,
    ) -> Result<EventStream> {
        let since_ns = since_ns.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        });
        // Only `type=container` and `type=image` are asked of the engine (and of Docker, the
        // events kept by their names), from a little before `since_ns`; labels, event names
        // and the instant are checked here (see `event_filters` and `since_param`).
        let by_name = matches!(*self.flavour().await?, Flavour::Docker);
        let options = EventsOptionsBuilder::new()
            .since(&since_param(since_ns))
            .filters(&event_filters(by_name))
            .build();
        let labels = labels.to_vec();
        // bollard's stream connects only when first read: a daemon that is down would show
        // as a subscription that breaks at once. One ping first makes it fail here, as the
        // trait says, so a subscriber backs off instead of counting a connection.
        self.docker
            .ping()
            .await
            .map_err(|e| translate("events", "containers".to_owned(), e))?;
        let stream = self.docker.events(Some(options)).filter_map(
            move |item: std::result::Result<EventMessage, BollardError>| {
                let event = match item {
                    Ok(msg) => container_event(msg, &labels, since_ns).map(Ok),
                    Err(err) => Some(Err(translate("events", "containers".to_owned(), err))),
                };
                std::future::ready(event)
            },
        );
        Ok(stream.boxed())
    }
}
