//! The Docker implementation of [`ContainerRuntime`], on bollard.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bollard::Docker;
use bollard::auth::DockerCredentials;
use bollard::errors::Error as BollardError;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, CreateImageInfo, DeviceMapping as DockerDevice,
    DeviceRequest as DockerDeviceRequest, EventMessage, HostConfig, PortBinding, PortMap,
    ResourcesUlimits,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, EventsOptionsBuilder,
    ListContainersOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
    StopContainerOptionsBuilder,
};
use futures_util::{StreamExt, TryStreamExt};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::spec::{ContainerSpec, DeviceMapping, DeviceRequest, NetworkMode};
use crate::types::{
    ContainerDetails, ContainerEvent, ContainerState, ContainerSummary, EventKind, MountPoint,
    PublishedPort, PullProgress, PullRequest,
};
use crate::{ContainerRuntime, EventStream, ProgressFn, Result, RuntimeError};

/// How long any request may wait for the daemon's answer to begin (streams then run on).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The [`ContainerRuntime`] backed by a Docker daemon.
#[derive(Debug, Clone)]
pub struct DockerRuntime {
    docker: Docker,
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

fn container(id: &str) -> String {
    format!("container {id}")
}

/// Docker's label filters: `key=value`, or `key` alone (the label is present) for an empty
/// value.
fn label_filters(labels: &[(String, String)]) -> HashMap<String, Vec<String>> {
    let values = labels
        .iter()
        .map(|(k, v)| {
            if v.is_empty() {
                k.clone()
            } else {
                format!("{k}={v}")
            }
        })
        .collect();
    HashMap::from([("label".to_owned(), values)])
}

/// The IPv4 host bindings of a container list entry, sorted.
fn summary_ports(ports: &[bollard::models::PortSummary]) -> Vec<PublishedPort> {
    let mut out: Vec<PublishedPort> = ports
        .iter()
        .filter(|p| {
            p.ip.as_deref()
                .is_some_and(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok())
        })
        .filter_map(|p| {
            Some(PublishedPort {
                container: p.private_port,
                host: p.public_port?,
            })
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Docker's "zero time" for never started/finished containers.
fn docker_time(t: Option<String>) -> Option<String> {
    t.filter(|t| !t.is_empty() && !t.starts_with("0001-01-01"))
}

fn strip_slash(name: &str) -> String {
    name.strip_prefix('/').unwrap_or(name).to_owned()
}

/// The IPv4 port bindings of a port map, as (container, host) pairs, sorted.
fn published_ports(ports: Option<&PortMap>) -> Vec<PublishedPort> {
    let mut out = Vec::new();
    for (key, bindings) in ports.into_iter().flatten() {
        let Some(container) = key.split('/').next().and_then(|p| p.parse::<u16>().ok()) else {
            continue;
        };
        for binding in bindings.iter().flatten() {
            let ipv4 = binding
                .host_ip
                .as_deref()
                .is_none_or(|ip| ip.is_empty() || ip.parse::<std::net::Ipv4Addr>().is_ok());
            let host = binding
                .host_port
                .as_deref()
                .and_then(|p| p.parse::<u16>().ok());
            if let (true, Some(host)) = (ipv4, host) {
                out.push(PublishedPort { container, host });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Builds Docker's create body from a spec.
pub(crate) fn create_body(spec: &ContainerSpec) -> ContainerCreateBody {
    let binds: Vec<String> = spec
        .mounts
        .iter()
        .map(|m| {
            let mode = if m.read_only { ":ro" } else { "" };
            format!("{}:{}{mode}", m.source.display(), m.target)
        })
        .collect();
    let bridge = spec.network == NetworkMode::Bridge;
    let exposed: Vec<String> = if bridge {
        spec.published_ports
            .iter()
            .map(|p| format!("{p}/tcp"))
            .collect()
    } else {
        Vec::new()
    };
    let port_bindings: PortMap = exposed
        .iter()
        .map(|key| {
            (
                key.clone(),
                Some(vec![PortBinding {
                    host_ip: Some("127.0.0.1".to_owned()),
                    host_port: Some(String::new()),
                }]),
            )
        })
        .collect();
    let opt_vec = |v: Vec<String>| (!v.is_empty()).then_some(v);
    let host_config = HostConfig {
        binds: opt_vec(binds),
        network_mode: Some(spec.network.as_str().to_owned()),
        port_bindings: (!port_bindings.is_empty()).then_some(port_bindings),
        nano_cpus: (spec.nano_cpus > 0).then_some(spec.nano_cpus),
        memory: (spec.memory > 0).then_some(spec.memory),
        privileged: Some(spec.privileged),
        shm_size: spec.shm_size,
        tmpfs: (!spec.tmpfs.is_empty()).then(|| {
            spec.tmpfs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        }),
        devices: (!spec.devices.is_empty()).then(|| {
            spec.devices
                .iter()
                .map(|d| DockerDevice {
                    path_on_host: Some(d.path_on_host.clone()),
                    path_in_container: Some(d.path_in_container.clone()),
                    cgroup_permissions: Some(d.cgroup_permissions.clone()),
                })
                .collect()
        }),
        device_requests: (!spec.device_requests.is_empty()).then(|| {
            spec.device_requests
                .iter()
                .map(|r| DockerDeviceRequest {
                    driver: Some(r.driver.clone()),
                    device_ids: Some(r.device_ids.clone()),
                    capabilities: Some(vec![r.capabilities.clone()]),
                    ..DockerDeviceRequest::default()
                })
                .collect()
        }),
        cap_add: opt_vec(spec.cap_add.clone()),
        ipc_mode: spec.ipc_mode.clone(),
        security_opt: opt_vec(spec.security_opt.clone()),
        runtime: spec.runtime.clone(),
        ulimits: (!spec.ulimits.is_empty()).then(|| {
            spec.ulimits
                .iter()
                .map(|u| ResourcesUlimits {
                    name: Some(u.name.clone()),
                    soft: Some(u.soft),
                    hard: Some(u.hard),
                })
                .collect()
        }),
        ..HostConfig::default()
    };
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        entrypoint: opt_vec(spec.entrypoint.clone()),
        cmd: opt_vec(spec.cmd.clone()),
        labels: Some(
            spec.labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        env: opt_vec(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        user: (!spec.user.is_empty()).then(|| spec.user.clone()),
        exposed_ports: opt_vec(exposed),
        host_config: Some(host_config),
        ..ContainerCreateBody::default()
    }
}

fn details(resp: ContainerInspectResponse) -> ContainerDetails {
    let state = resp.state.unwrap_or_default();
    let host = resp.host_config.unwrap_or_default();
    let config = resp.config.unwrap_or_default();
    ContainerDetails {
        id: resp.id.unwrap_or_default(),
        name: strip_slash(resp.name.as_deref().unwrap_or_default()),
        image: config.image.unwrap_or_default(),
        state: state
            .status
            .map_or(ContainerState::Other(String::new()), |s| {
                ContainerState::parse(s.as_ref())
            }),
        exit_code: state.exit_code,
        error: state.error.unwrap_or_default(),
        oom_killed: state.oom_killed.unwrap_or(false),
        started_at: docker_time(state.started_at),
        finished_at: docker_time(state.finished_at),
        labels: config.labels.unwrap_or_default().into_iter().collect(),
        ports: published_ports(
            resp.network_settings
                .as_ref()
                .and_then(|n| n.ports.as_ref()),
        ),
        mounts: resp
            .mounts
            .unwrap_or_default()
            .into_iter()
            .map(|m| MountPoint {
                source: m.source.unwrap_or_default(),
                destination: m.destination.unwrap_or_default(),
                read_write: m.rw.unwrap_or(false),
            })
            .collect(),
        env: config.env.unwrap_or_default(),
        device_requests: host
            .device_requests
            .unwrap_or_default()
            .into_iter()
            .map(|r| DeviceRequest {
                driver: r.driver.unwrap_or_default(),
                device_ids: r.device_ids.unwrap_or_default(),
                capabilities: r
                    .capabilities
                    .unwrap_or_default()
                    .into_iter()
                    .flatten()
                    .collect(),
            })
            .collect(),
        devices: host
            .devices
            .unwrap_or_default()
            .into_iter()
            .map(|d| DeviceMapping {
                path_on_host: d.path_on_host.unwrap_or_default(),
                path_in_container: d.path_in_container.unwrap_or_default(),
                cgroup_permissions: d.cgroup_permissions.unwrap_or_default(),
            })
            .collect(),
        network_mode: host.network_mode.unwrap_or_default(),
        nano_cpus: host.nano_cpus.unwrap_or(0),
        memory: host.memory.unwrap_or(0),
        privileged: host.privileged.unwrap_or(false),
        shm_size: host.shm_size.unwrap_or(0),
        tmpfs: host.tmpfs.unwrap_or_default().into_iter().collect(),
        user: config.user.unwrap_or_default(),
    }
}

/// One layer's progress.
#[derive(Debug, Default, Clone, Copy)]
struct Layer {
    total: Option<u64>,
    downloaded: u64,
    extracted: u64,
    done: bool,
}

/// Folds the daemon's per-layer pull messages into [`PullProgress`].
#[derive(Debug, Default)]
pub(crate) struct ProgressFolder {
    layers: BTreeMap<String, Layer>,
}

impl ProgressFolder {
    /// Feeds one message; returns whether the progress changed.
    pub(crate) fn feed(&mut self, info: &CreateImageInfo) -> bool {
        let (Some(id), Some(status)) = (info.id.as_deref(), info.status.as_deref()) else {
            return false;
        };
        let detail = info.progress_detail.as_ref();
        let current = detail
            .and_then(|d| d.current)
            .and_then(|c| u64::try_from(c).ok());
        let total = detail
            .and_then(|d| d.total)
            .and_then(|t| u64::try_from(t).ok())
            .filter(|t| *t > 0);
        let layer_status = matches!(
            status,
            "Pulling fs layer"
                | "Waiting"
                | "Downloading"
                | "Verifying Checksum"
                | "Download complete"
                | "Extracting"
                | "Pull complete"
                | "Already exists"
        );
        if !layer_status {
            return false;
        }
        let is_new = !self.layers.contains_key(id);
        let layer = self.layers.entry(id.to_owned()).or_default();
        let before = (layer.total, layer.downloaded, layer.extracted, layer.done);
        match status {
            "Downloading" => {
                if let Some(t) = total {
                    layer.total = Some(t);
                }
                if let Some(c) = current {
                    layer.downloaded = c;
                }
            }
            "Verifying Checksum" | "Download complete" => {
                if let Some(t) = layer.total {
                    layer.downloaded = t;
                }
            }
            "Extracting" => {
                if let Some(t) = total {
                    layer.total = Some(layer.total.map_or(t, |old| old.max(t)));
                    layer.downloaded = layer.downloaded.max(t);
                }
                if let Some(c) = current {
                    layer.extracted = c;
                }
            }
            "Pull complete" => {
                layer.done = true;
                if let Some(t) = layer.total {
                    layer.downloaded = t;
                    layer.extracted = t;
                }
            }
            "Already exists" => {
                layer.done = true;
                layer.total.get_or_insert(0);
            }
            _ => {}
        }
        is_new || before != (layer.total, layer.downloaded, layer.extracted, layer.done)
    }

    /// The folded progress.
    pub(crate) fn progress(&self, finished: bool) -> PullProgress {
        let mut p = PullProgress::default();
        let mut all_known = !self.layers.is_empty();
        for layer in self.layers.values() {
            p.downloaded_bytes += layer.downloaded;
            p.extracted_bytes += layer.extracted;
            match layer.total {
                Some(t) => p.total_bytes += t,
                None => all_known &= layer.done,
            }
        }
        p.is_total_bytes_final = finished || all_known;
        p
    }
}

/// Writes the pull's progress messages as JSON lines.
struct PullLog {
    path: std::path::PathBuf,
    out: tokio::io::BufWriter<tokio::fs::File>,
}

impl PullLog {
    async fn create(path: &Path) -> Result<Self> {
        let file = tokio::fs::File::create(path)
            .await
            .map_err(|source| RuntimeError::PullLog {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            path: path.to_owned(),
            out: tokio::io::BufWriter::new(file),
        })
    }

    async fn write(&mut self, info: &CreateImageInfo) -> Result<()> {
        let mut line = serde_json::to_vec(info).map_err(|e| RuntimeError::PullLog {
            path: self.path.clone(),
            source: e.into(),
        })?;
        line.push(b'\n');
        self.out
            .write_all(&line)
            .await
            .map_err(|source| RuntimeError::PullLog {
                path: self.path.clone(),
                source,
            })
    }

    async fn finish(mut self) {
        if let Err(err) = self.out.flush().await {
            warn!(path = %self.path.display(), %err, "cannot flush pull log");
        }
    }
}

impl DockerRuntime {
    /// Connects through `DOCKER_HOST` or the default socket and negotiates the API version.
    pub async fn connect() -> Result<Self> {
        let docker = Docker::connect_with_defaults()
            .map_err(|e| translate("connect", "docker daemon".to_owned(), e))?;
        Self::from_client(docker).await
    }

    /// Connects to `host` (`unix:///path`, `tcp://…`, as in `DOCKER_HOST`) and negotiates the
    /// API version.
    pub async fn connect_to(host: &str) -> Result<Self> {
        let docker = Docker::connect_with_host(host)
            .map_err(|e| translate("connect", format!("docker daemon at {host}"), e))?;
        Self::from_client(docker).await
    }

    /// Wraps a bollard client, negotiating the API version. Every request gets at most
    /// `REQUEST_TIMEOUT` (30 s) for its response to begin (a frozen daemon does not hang the
    /// shim); a stop gets its grace period on top.
    pub async fn from_client(docker: Docker) -> Result<Self> {
        let docker = docker
            .with_timeout(REQUEST_TIMEOUT)
            .negotiate_version()
            .await
            .map_err(|e| translate("negotiate version", "docker daemon".to_owned(), e))?;
        Ok(Self { docker })
    }

    /// The underlying bollard client.
    pub fn client(&self) -> &Docker {
        &self.docker
    }

    async fn pull_stream(
        &self,
        request: &PullRequest,
        image: &str,
        folder: &mut ProgressFolder,
        progress: ProgressFn<'_>,
        log: &mut Option<PullLog>,
    ) -> Result<()> {
        let options = CreateImageOptionsBuilder::new().from_image(image).build();
        let credentials = request.auth.as_ref().map(|a| DockerCredentials {
            username: Some(a.username.clone()),
            password: Some(a.password.clone()),
            ..DockerCredentials::default()
        });
        let mut stream = self.docker.create_image(Some(options), None, credentials);
        while let Some(item) = stream.next().await {
            match item {
                Ok(info) => {
                    if let Some(log) = log.as_mut() {
                        log.write(&info).await?;
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
            Ok(_) => Ok(true),
            Err(err) => match translate("inspect image", format!("image {image}"), err) {
                RuntimeError::NotFound { .. } => Ok(false),
                other => Err(other),
            },
        }
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
            () = tokio::time::sleep(request.timeout) => Err(RuntimeError::PullTimeout {
                image: image.clone(),
                timeout: request.timeout,
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
        let options = CreateContainerOptionsBuilder::new()
            .name(&spec.name)
            .build();
        let resp = self
            .docker
            .create_container(Some(options), create_body(spec))
            .await
            .map_err(|e| match translate("create", container(&spec.name), e) {
                // 404 on create means the image is missing.
                RuntimeError::NotFound { .. } => RuntimeError::NotFound {
                    what: format!("image {}", spec.image),
                },
                other => other,
            })?;
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
        let resp = self
            .docker
            .inspect_container(
                id_or_name,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
            .map_err(|e| translate("inspect", container(id_or_name), e))?;
        Ok(details(resp))
    }

    async fn list(&self, labels: &[(String, String)]) -> Result<Vec<ContainerSummary>> {
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&label_filters(labels))
            .build();
        let containers = self
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|e| translate("list", "containers".to_owned(), e))?;
        Ok(containers
            .into_iter()
            .map(|c| ContainerSummary {
                id: c.id.unwrap_or_default(),
                name: c
                    .names
                    .and_then(|n| n.into_iter().next())
                    .map(|n| strip_slash(&n))
                    .unwrap_or_default(),
                state: c.state.map_or(ContainerState::Other(String::new()), |s| {
                    ContainerState::parse(s.as_ref())
                }),
                labels: c.labels.unwrap_or_default().into_iter().collect(),
                ports: summary_ports(c.ports.as_deref().unwrap_or_default()),
                mounts: c
                    .mounts
                    .unwrap_or_default()
                    .into_iter()
                    .map(|m| MountPoint {
                        source: m.source.unwrap_or_default(),
                        destination: m.destination.unwrap_or_default(),
                        read_write: m.rw.unwrap_or(false),
                    })
                    .collect(),
            })
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
        let chunks: Vec<_> = self
            .docker
            .logs(id, Some(options))
            .try_collect()
            .await
            .map_err(|e| translate("logs", container(id), e))?;
        let mut bytes = Vec::new();
        for chunk in chunks {
            bytes.extend_from_slice(&chunk.into_bytes());
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
        let since = format!(
            "{}.{:09}",
            since_ns.div_euclid(1_000_000_000),
            since_ns.rem_euclid(1_000_000_000)
        );
        let mut filters = label_filters(labels);
        filters.insert("type".to_owned(), vec!["container".to_owned()]);
        filters.insert(
            "event".to_owned(),
            vec!["die".to_owned(), "oom".to_owned(), "destroy".to_owned()],
        );
        let options = EventsOptionsBuilder::new()
            .since(&since)
            .filters(&filters)
            .build();
        let stream = self.docker.events(Some(options)).filter_map(
            |item: std::result::Result<EventMessage, BollardError>| async move {
                match item {
                    Ok(msg) => container_event(msg).map(Ok),
                    Err(err) => Some(Err(translate("events", "containers".to_owned(), err))),
                }
            },
        );
        Ok(stream.boxed())
    }
}

fn container_event(msg: EventMessage) -> Option<ContainerEvent> {
    let mut actor = msg.actor?;
    let container_id = actor.id?;
    let attributes = actor.attributes.take().unwrap_or_default();
    let kind = match msg.action.as_deref()? {
        "die" => EventKind::Die {
            exit_code: attributes
                .get("exitCode")
                .and_then(|c| c.parse::<i64>().ok()),
        },
        "oom" => EventKind::Oom,
        "destroy" => EventKind::Destroy,
        _ => return None,
    };
    let name = attributes
        .get("name")
        .map(|n| strip_slash(n))
        .unwrap_or_default();
    let time_ns = msg
        .time_nano
        .or_else(|| msg.time.map(|t| t.saturating_mul(1_000_000_000)))
        .unwrap_or(0);
    Some(ContainerEvent {
        container_id,
        name,
        kind,
        // Docker puts the labels among the attributes, with name, image and exitCode.
        labels: attributes.into_iter().collect(),
        time_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::ProgressDetail;

    fn msg(id: &str, status: &str, current: Option<i64>, total: Option<i64>) -> CreateImageInfo {
        CreateImageInfo {
            id: Some(id.to_owned()),
            status: Some(status.to_owned()),
            progress_detail: Some(ProgressDetail { current, total }),
            ..CreateImageInfo::default()
        }
    }

    #[test]
    fn progress_folds_layers() {
        let mut f = ProgressFolder::default();
        assert!(!f.progress(false).is_total_bytes_final);
        assert!(!f.feed(&CreateImageInfo {
            status: Some("Pulling from x".to_owned()),
            id: Some("1".to_owned()),
            ..CreateImageInfo::default()
        }));
        assert!(f.feed(&msg("a", "Pulling fs layer", None, None)));
        assert!(f.feed(&msg("b", "Pulling fs layer", None, None)));
        assert!(f.feed(&msg("c", "Already exists", None, None)));
        assert!(f.feed(&msg("a", "Downloading", Some(10), Some(100))));
        let p = f.progress(false);
        assert_eq!((p.downloaded_bytes, p.total_bytes), (10, 100));
        assert!(!p.is_total_bytes_final, "layer b has no size yet");
        assert!(f.feed(&msg("b", "Downloading", Some(5), Some(50))));
        let p = f.progress(false);
        assert_eq!((p.downloaded_bytes, p.total_bytes), (15, 150));
        assert!(p.is_total_bytes_final);
        f.feed(&msg("a", "Download complete", None, None));
        f.feed(&msg("a", "Extracting", Some(40), Some(100)));
        let p = f.progress(false);
        assert_eq!((p.downloaded_bytes, p.extracted_bytes), (105, 40));
        f.feed(&msg("a", "Pull complete", None, None));
        f.feed(&msg("b", "Pull complete", None, None));
        let p = f.progress(true);
        assert_eq!(
            p,
            PullProgress {
                downloaded_bytes: 150,
                extracted_bytes: 150,
                total_bytes: 150,
                is_total_bytes_final: true
            }
        );
    }

    #[test]
    fn ports_ipv4_only() {
        let map: PortMap = HashMap::from([
            (
                "10999/tcp".to_owned(),
                Some(vec![
                    PortBinding {
                        host_ip: Some("127.0.0.1".to_owned()),
                        host_port: Some("32770".to_owned()),
                    },
                    PortBinding {
                        host_ip: Some("::1".to_owned()),
                        host_port: Some("32771".to_owned()),
                    },
                ]),
            ),
            ("10022/tcp".to_owned(), None),
        ]);
        assert_eq!(
            published_ports(Some(&map)),
            [PublishedPort {
                container: 10999,
                host: 32770
            }]
        );
        assert!(published_ports(None).is_empty());
    }

    #[test]
    fn body_bridge_and_shm() {
        let spec = ContainerSpec {
            name: "n".to_owned(),
            image: "i:1".to_owned(),
            network: NetworkMode::Bridge,
            published_ports: vec![10999],
            shm_size: Some(1 << 20),
            tmpfs: BTreeMap::from([("/dev/shm".to_owned(), "exec,size=1048576".to_owned())]),
            mounts: vec![crate::spec::BindMount {
                source: "/a".into(),
                target: "/b".to_owned(),
                read_only: true,
            }],
            ..ContainerSpec::default()
        };
        let body = create_body(&spec);
        let host = body.host_config.unwrap();
        assert_eq!(host.binds.unwrap(), ["/a:/b:ro"]);
        assert_eq!(host.shm_size, Some(1 << 20));
        assert_eq!(host.tmpfs.unwrap()["/dev/shm"], "exec,size=1048576");
        let bindings = host.port_bindings.unwrap();
        let b = &bindings["10999/tcp"].as_ref().unwrap()[0];
        assert_eq!(b.host_ip.as_deref(), Some("127.0.0.1"));
        assert_eq!(b.host_port.as_deref(), Some(""));
        assert_eq!(body.exposed_ports.unwrap(), ["10999/tcp"]);

        let host_mode = create_body(&ContainerSpec {
            network: NetworkMode::Host,
            ..spec
        });
        assert!(host_mode.exposed_ports.is_none());
        assert!(host_mode.host_config.unwrap().port_bindings.is_none());
    }
}
