//! The engine behind the API (feature `engine`): [`ShimApi`] implemented over
//! `shim_engine::Engine`, so an agent that embeds the engine serves dstack's API in a few
//! lines. The engine's error kinds become API error kinds (the status codes themselves are
//! chosen in [`ErrorKind::status`](crate::ErrorKind::status)); its task changes are the change
//! feed (`GET /api/events`), its metrics with the build info in one registry (`GET /metrics`),
//! its health the readiness (`GET /api/ready`); DCGM, where it runs, answers the instance's
//! GPU health and a task's GPU metrics.
//!
//! ```no_run
//! # async fn f(engine: shim_engine::Engine) -> Result<(), shim_http::HttpError> {
//! use std::sync::Arc;
//! use shim_http::{EngineApi, Listeners, NoComponents, ServerConfig, serve};
//! let listeners = Listeners::bind("127.0.0.1:10998".parse().unwrap(), None).await?;
//! let api = Arc::new(EngineApi::new(engine, "0.22.5+my-agent.1"));
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! serve(listeners, api, Arc::new(NoComponents), ServerConfig::new("0.22.5+my-agent.1"), shutdown).await
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use shim_engine::prometheus_client::encoding::text::encode;
use shim_engine::prometheus_client::metrics::info::Info;
use shim_engine::prometheus_client::registry::Registry;
use shim_engine::{Engine, EngineError, ErrorKind, Subscription, SubscriptionError};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};
use shim_util::error_chain as chain;

use crate::{ApiError, ChangeEvent, ChangeFeed, FeedError, InstanceInfo, Readiness, ShimApi};

/// How long a `GET /metrics` waits for dcgm-exporter's answer (a hung exporter would hold
/// every scrape for its fetch timeout, 10 s, Prometheus' own scrape timeout).
const SCRAPE_GPUS_WAIT: Duration = Duration::from_secs(2);

/// How long `GET /api/instance/health` waits for DCGM's check before it answers with the last
/// one read: well within the dstack server's 9 s for the request.
pub(crate) const INSTANCE_HEALTH_BUDGET: Duration = Duration::from_secs(5);

/// The engine's part of a server's shutdown, the same for every agent that embeds it: the
/// drain ([`EngineShutdown::drain`], given to [`ServerConfig::with_drain`](crate::ServerConfig::with_drain))
/// runs what the agent must stop first, then shuts the engine down gracefully (start jobs in
/// flight finish, bounded by `grace`, so no task is left half-started); once
/// [`serve`](crate::serve) returned, [`EngineShutdown::finish`] shuts it down at once if a
/// forced shutdown cut the drain short. Containers keep running either way.
///
/// ```no_run
/// # async fn f(engine: shim_engine::Engine, listeners: shim_http::Listeners) -> Result<(), shim_http::HttpError> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use shim_http::{EngineApi, EngineShutdown, NoComponents, ServerConfig, serve};
/// let down = EngineShutdown::new(engine.clone(), Duration::from_secs(30));
/// let config = ServerConfig::new("0.22.5+my-agent.1").with_drain(down.drain(async {}));
/// let api = Arc::new(EngineApi::new(engine, "0.22.5+my-agent.1"));
/// let stop = tokio_util::sync::CancellationToken::new();
/// serve(listeners, api, Arc::new(NoComponents), config, stop).await?;
/// down.finish().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EngineShutdown {
    engine: Engine,
    grace: Duration,
    drained: Arc<std::sync::atomic::AtomicBool>,
}

impl EngineShutdown {
    /// The shutdown of `engine`, waiting at most `grace` for its start jobs.
    pub fn new(engine: Engine, grace: Duration) -> Self {
        Self {
            engine,
            grace,
            drained: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// The drain: `first` (what the agent stops before the engine: its downloads, say), then
    /// the engine's graceful shutdown.
    pub fn drain(
        &self,
        first: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let this = self.clone();
        async move {
            first.await;
            this.engine
                .shutdown(shim_engine::Shutdown::Graceful(this.grace))
                .await;
            this.drained
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// After [`serve`](crate::serve) returned: the engine shut down at once unless the drain
    /// did it (a forced shutdown cuts the drain short).
    pub async fn finish(self) {
        if !self.drained.load(std::sync::atomic::Ordering::SeqCst) {
            self.engine.shutdown(shim_engine::Shutdown::Now).await;
        }
    }
}

impl std::fmt::Debug for EngineShutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineShutdown")
            .field("grace", &self.grace)
            .field("drained", &self.drained)
            .finish_non_exhaustive()
    }
}

/// The engine behind the API, and DCGM where it runs.
pub struct EngineApi {
    engine: Engine,
    dcgm: Option<Arc<shim_dcgm::Dcgm>>,
    /// The engine's metrics, the build info and the tasks' GPUs.
    registry: Registry,
    /// The tasks' GPU figures of the last scrape (read by the registry's collector).
    task_gpus: Arc<TaskGpus>,
}

impl EngineApi {
    /// The API over `engine`; `version` is the build's, served as
    /// `dstack_shim_build_info{version}` in `GET /metrics`. Without DCGM
    /// ([`EngineApi::with_dcgm`]) GPU health is unknown and a task's GPU metrics are 404.
    pub fn new(engine: Engine, version: &str) -> Self {
        let task_gpus = Arc::new(TaskGpus::default());
        let mut registry = metrics_registry(&engine, version);
        registry.register_collector(Box::new(TaskGpusCollector(task_gpus.clone())));
        Self {
            engine,
            dcgm: None,
            registry,
            task_gpus,
        }
    }

    /// Joins DCGM's figures with the GPUs each running task holds, for this scrape (nothing
    /// without an exporter, or when it fails or takes more than [`SCRAPE_GPUS_WAIT`]: the
    /// families are then absent, and the engine's own are answered at once).
    async fn refresh_task_gpus(&self) {
        let Some(exporter) = self.dcgm.as_ref().and_then(|d| d.exporter.as_ref()) else {
            return;
        };
        let fetched = tokio::time::timeout(SCRAPE_GPUS_WAIT, exporter.fetch()).await;
        let readings = match fetched {
            Err(_) => {
                tracing::debug!(wait = ?SCRAPE_GPUS_WAIT, "no GPU figures for this scrape: the exporter did not answer in time");
                Vec::new()
            }
            Ok(Ok(text)) => {
                let tasks: Vec<(String, Vec<String>)> = self
                    .engine
                    .list()
                    .into_iter()
                    .filter(|(_, status)| *status == TaskStatus::Running)
                    .filter_map(|(id, _)| {
                        let gpus = self.engine.task_info(&id).ok()?.gpu_ids?;
                        (!gpus.is_empty()).then(|| (id.to_string(), gpus))
                    })
                    .collect();
                join_task_gpus(&text, &tasks)
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %chain(&e), "no GPU figures for this scrape: the exporter failed");
                Vec::new()
            }
        };
        *self.task_gpus.lock() = readings;
    }

    /// DCGM answers `GET /api/instance/health` and `GET /metrics/tasks/{id}`.
    #[must_use]
    pub fn with_dcgm(mut self, dcgm: Arc<shim_dcgm::Dcgm>) -> Self {
        self.dcgm = Some(dcgm);
        self
    }

    /// The engine served.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

/// The engine's metrics with the build info (`dstack_shim_build_info{version}`, an
/// OpenMetrics `info`, which Prometheus reads as a gauge of 1).
fn metrics_registry(engine: &Engine, version: &str) -> Registry {
    let mut registry = Registry::default();
    engine.register_metrics(&mut registry);
    registry.register(
        "dstack_shim_build",
        "The dstack-shim binary's version",
        Info::new(vec![("version".to_owned(), version.to_owned())]),
    );
    registry
}

/// The engine's task changes as the HTTP layer's change feed.
struct EngineFeed(Subscription);

#[async_trait]
impl ChangeFeed for EngineFeed {
    /// Cancel-safe: the engine's subscription is a broadcast receiver.
    async fn recv(&mut self) -> Result<ChangeEvent, FeedError> {
        loop {
            let change = match self.0.recv().await {
                Ok(change) => change,
                Err(SubscriptionError::Lagged { missed }) => {
                    return Err(FeedError::Lagged { missed });
                }
                // Closed (or what a later version adds): the stream ends.
                Err(_) => return Err(FeedError::Closed),
            };
            match serde_json::to_string(&change) {
                Ok(json) => {
                    return Ok(ChangeEvent {
                        seq: change.seq,
                        json,
                    });
                }
                // Cannot happen (plain data); never end the stream over it.
                Err(e) => {
                    tracing::error!(task = %change.task, error = %e, "cannot encode a task change");
                }
            }
        }
    }
}

/// The engine's health as the API's readiness: the engine's verdict and reasons.
fn readiness(health: &shim_engine::EngineHealth) -> Readiness {
    Readiness::new(health.is_ready(), health.reasons()).with_runtime(
        health.events_connected,
        health.last_cycle_age.map(|a| a.as_secs_f64()),
        health.max_cycle_age().as_secs_f64(),
    )
}

/// An engine error as the API answers it: the engine's kind, the whole chain as the body.
fn api_error(e: EngineError) -> ApiError {
    let message = chain(&e);
    match e.kind() {
        ErrorKind::NotFound => ApiError::not_found(message),
        ErrorKind::Conflict => ApiError::conflict(message),
        ErrorKind::InvalidInput => ApiError::bad_request(message),
        _ => ApiError::internal(message).with_source(e),
    }
}

#[async_trait]
impl ShimApi for EngineApi {
    async fn submit(&self, config: TaskConfig) -> Result<TaskInfo, ApiError> {
        self.engine.submit(config).await.map_err(api_error)
    }

    async fn task_info(&self, id: &TaskId) -> Result<TaskInfo, ApiError> {
        self.engine.task_info(id).map_err(api_error)
    }

    async fn list_tasks(&self) -> Vec<(TaskId, TaskStatus)> {
        self.engine.list()
    }

    async fn terminate(
        &self,
        id: &TaskId,
        reason: TerminationReason,
        message: String,
        timeout_s: u64,
    ) -> Result<TaskInfo, ApiError> {
        self.engine
            .terminate(id, reason, message, Duration::from_secs(timeout_s))
            .await
            .map_err(api_error)
    }

    async fn remove(&self, id: &TaskId) -> Result<(), ApiError> {
        self.engine.remove(id).await.map_err(api_error)
    }

    async fn instance_info(&self) -> InstanceInfo {
        let gpus = self.engine.host_gpus();
        InstanceInfo {
            gpu_vendor: gpus.vendor.map(|v| v.as_str().to_owned()),
            gpu_driver_version: gpus.driver_version.clone(),
        }
    }

    /// As upstream (`runner/internal/shim/api/handlers.go`, `InstanceHealthHandler`):
    /// without DCGM, or when it fails, GPU health is unknown: `{"dcgm":null}`; a DCGM check
    /// late by `INSTANCE_HEALTH_BUDGET` answers with the last one read, if recent (the
    /// server's 9 s would otherwise make the instance unreachable). Where the
    /// engine watches the GPUs' health (an NVIDIA host), also `"gpus"`: each GPU's id, index
    /// and the reasons it is kept from new tasks (`[]`: healthy), a field the dstack server
    /// ignores (its client reads answers with extra fields ignored).
    async fn instance_health(&self) -> serde_json::Value {
        let health = match self.dcgm.as_ref().and_then(|d| d.health.as_ref()) {
            Some(h) => h.instance_health_within(INSTANCE_HEALTH_BUDGET).await,
            None => shim_dcgm::InstanceHealth::default(),
        };
        // Plain data: encoding cannot fail; were it to, the answer is still "unknown".
        let mut answer =
            serde_json::to_value(health).unwrap_or_else(|_| serde_json::json!({ "dcgm": null }));
        if let (Some(report), Some(fields)) = (self.engine.gpu_health(), answer.as_object_mut()) {
            let gpus: Vec<serde_json::Value> = report
                .gpus
                .iter()
                .map(|g| {
                    serde_json::json!({
                        "id": g.uuid,
                        "index": g.index,
                        "healthy": g.is_healthy(),
                        "reasons": g.reasons.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    })
                })
                .collect();
            fields.insert("gpus".to_owned(), serde_json::Value::Array(gpus));
        }
        answer
    }

    /// As upstream (`runner/internal/shim/api/handlers.go`, `TaskMetricsHandler`): an
    /// exporter failure is 502 (no exporter and an unknown task are the handler's answers).
    async fn task_metrics(&self, id: &TaskId) -> Result<String, ApiError> {
        let Some(exporter) = self.dcgm.as_ref().and_then(|d| d.exporter.as_ref()) else {
            return Err(ApiError::internal("no DCGM exporter"));
        };
        let info = self.engine.task_info(id).map_err(api_error)?;
        exporter
            .fetch_task_metrics(&info.gpu_ids.unwrap_or_default())
            .await
            .map_err(|e| match e.kind() {
                shim_dcgm::DcgmErrorKind::Upstream => ApiError::bad_gateway(chain(&e)),
                shim_dcgm::DcgmErrorKind::Internal => ApiError::internal(chain(&e)),
            })
    }

    fn has_task_metrics(&self) -> bool {
        self.dcgm.as_ref().is_some_and(|d| d.exporter.is_some())
    }

    fn subscribe(&self) -> Result<Box<dyn ChangeFeed>, ApiError> {
        Ok(Box::new(EngineFeed(self.engine.subscribe())))
    }

    async fn metrics(&self) -> Result<String, ApiError> {
        self.refresh_task_gpus().await;
        let mut text = String::new();
        encode(&mut text, &self.registry)
            .map_err(|e| ApiError::internal(format!("cannot encode the metrics: {e}")))?;
        Ok(text)
    }

    async fn readiness(&self) -> Readiness {
        readiness(&self.engine.health())
    }
}

/// One GPU of one running task, as DCGM measured it.
#[derive(Debug, Clone, PartialEq)]
struct TaskGpu {
    task_id: String,
    /// The GPU's id as the task holds it (NVIDIA: its UUID).
    gpu: String,
    /// `DCGM_FI_DEV_GPU_UTIL`, percent (the mean over a MIG GPU's instances).
    utilization_percent: Option<f64>,
    /// `DCGM_FI_DEV_FB_USED` in bytes (summed over a MIG GPU's instances).
    memory_used_bytes: Option<f64>,
}

/// The tasks' GPU figures of the last scrape.
#[derive(Debug, Default)]
struct TaskGpus(std::sync::Mutex<Vec<TaskGpu>>);

impl TaskGpus {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<TaskGpu>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The join of dcgm-exporter's text (`text`) with the GPU ids each task holds: one
/// [`TaskGpu`] per GPU the exporter reports (by its `UUID` label), none for a GPU it does not.
/// The shim knows which GPUs a task has; DCGM is the one source of what they do.
fn join_task_gpus(text: &str, tasks: &[(String, Vec<String>)]) -> Vec<TaskGpu> {
    const UTIL: &str = "DCGM_FI_DEV_GPU_UTIL";
    const FB_USED: &str = "DCGM_FI_DEV_FB_USED";
    // uuid → (utilization sum, samples, memory MiB sum, samples)
    let mut seen: std::collections::BTreeMap<String, (f64, u32, f64, u32)> = Default::default();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Ok(sample) = shim_dcgm::parse_sample(line) else {
            continue;
        };
        if sample.name != UTIL && sample.name != FB_USED {
            continue;
        }
        let Some(uuid) = shim_dcgm::UUID_LABELS.iter().find_map(|l| sample.label(l)) else {
            continue;
        };
        let entry = seen.entry(uuid.to_owned()).or_default();
        if sample.name == UTIL {
            entry.0 += sample.value;
            entry.1 += 1;
        } else {
            entry.2 += sample.value;
            entry.3 += 1;
        }
    }
    let mut out = Vec::new();
    for (task_id, gpus) in tasks {
        for gpu in gpus {
            let Some(&(util, util_n, mem, mem_n)) = seen.get(gpu) else {
                continue;
            };
            out.push(TaskGpu {
                task_id: task_id.clone(),
                gpu: gpu.clone(),
                utilization_percent: (util_n > 0).then(|| util / f64::from(util_n)),
                memory_used_bytes: (mem_n > 0).then_some(mem * 1_048_576.0),
            });
        }
    }
    out
}

/// One figure of a [`TaskGpu`].
type GpuFigure = fn(&TaskGpu) -> Option<f64>;

/// The registry's view of [`TaskGpus`]: `dstack_shim_task_gpu_utilization_percent` and
/// `dstack_shim_task_gpu_memory_used_bytes`, labelled `task_id` and `gpu`.
#[derive(Debug)]
struct TaskGpusCollector(Arc<TaskGpus>);

impl shim_engine::prometheus_client::collector::Collector for TaskGpusCollector {
    fn encode(
        &self,
        mut encoder: shim_engine::prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use shim_engine::prometheus_client::encoding::EncodeMetric as _;
        use shim_engine::prometheus_client::metrics::MetricType;
        use shim_engine::prometheus_client::metrics::gauge::ConstGauge;
        let readings = self.0.lock().clone();
        let families: [(&str, &str, GpuFigure); 2] = [
            (
                "dstack_shim_task_gpu_utilization_percent",
                "Utilization of a GPU the task holds (DCGM_FI_DEV_GPU_UTIL; the mean over a MIG GPU's instances)",
                |g| g.utilization_percent,
            ),
            (
                "dstack_shim_task_gpu_memory_used_bytes",
                "Frame buffer memory used on a GPU the task holds (DCGM_FI_DEV_FB_USED)",
                |g| g.memory_used_bytes,
            ),
        ];
        for (name, help, value) in families {
            let samples: Vec<(&TaskGpu, f64)> = readings
                .iter()
                .filter_map(|g| value(g).map(|v| (g, v)))
                .collect();
            if samples.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (g, v) in samples {
                let labels = [("task_id", g.task_id.as_str()), ("gpu", g.gpu.as_str())];
                ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An engine on the fake runtime whose next start hangs until released, with task `t1`
    /// submitted and its start job in flight.
    async fn engine_with_a_start_in_flight(
        home: &std::path::Path,
    ) -> (Engine, shim_runtime::fake::FakeRuntime) {
        use shim_resources::fake::{FakeAuthorizedKeys, FakeVolumes};
        let fake = shim_runtime::fake::FakeRuntime::new();
        fake.add_image(&shim_e2e::image());
        fake.queue_start_behavior(shim_runtime::fake::StartBehavior::Hang);
        let mut cfg = shim_engine::EngineConfig::new(home.join("home"));
        cfg.runner_binary_path = home.join("dstack-runner");
        let deps = shim_engine::Deps::new(
            Arc::new(fake.clone()),
            Arc::new(FakeAuthorizedKeys::new()),
            Arc::new(FakeVolumes::new(home.join("volumes"))),
        );
        let engine = Engine::open(cfg, deps).await.unwrap();
        let task = shim_e2e::harness::bridge_task("t1", "t1", 0);
        engine
            .submit(serde_json::from_value(task).unwrap())
            .await
            .unwrap();
        let id = TaskId::new("t1").unwrap();
        while !engine.is_starting(&id).unwrap() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (engine, fake)
    }

    /// A dcgm-exporter that takes connections and never answers (its DCGM calls stuck on a
    /// wedged GPU) costs a scrape of `/metrics` at most `SCRAPE_GPUS_WAIT`: the engine's own
    /// families come without the GPU ones. Each scrape used to wait the exporter's fetch
    /// timeout (10 s, Prometheus' own scrape timeout), so every engine series went stale.
    #[tokio::test(start_paused = true)]
    async fn a_hung_exporter_holds_a_metrics_scrape_two_seconds_at_most() {
        use std::os::unix::fs::PermissionsExt as _;
        let home = tempfile::tempdir().unwrap();
        let (engine, _fake) = engine_with_a_start_in_flight(home.path()).await;
        // Takes connections (the kernel's backlog) and never answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let program = home.path().join("dcgm-exporter");
        let script = "#!/bin/sh\n[ \"$1\" = -v ] && { echo 'DCGM Exporter version 4.1.1'; exit 0; }\nexec sleep 600\n";
        fs_err::write(&program, script).unwrap();
        fs_err::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let config = shim_dcgm::DcgmConfig {
            exporter_http_port: silent.local_addr().unwrap().port(),
            state_dir: Some(home.path().to_path_buf()),
            ..shim_dcgm::DcgmConfig::default()
        };
        let exporter = shim_dcgm::DcgmExporter::spawn(&program, &config).unwrap();
        let hung = tokio::time::timeout(Duration::from_secs(5), exporter.fetch()).await;
        assert!(hung.is_err(), "the exporter answered: {hung:?}");
        let dcgm = shim_dcgm::Dcgm {
            exporter: Some(exporter),
            health: None,
        };
        let api = EngineApi::new(engine, "0.0.0").with_dcgm(Arc::new(dcgm));
        let began = tokio::time::Instant::now();
        let text = api.metrics().await.unwrap();
        // Not the exporter's fetch timeout (10 s).
        let took = began.elapsed();
        assert!(took <= Duration::from_secs(3), "{took:?}");
        assert!(text.contains("dstack_shim_events_connected"), "{text}");
    }

    /// The drain runs the agent's part first, then waits for a start in flight (here released
    /// after 5 s), which ends with the task running; `finish` has nothing left to do. Bounded:
    /// a start that never returns is left after the grace.
    #[tokio::test(start_paused = true)]
    async fn the_drain_lets_a_start_in_flight_finish_within_the_grace() {
        let home = tempfile::tempdir().unwrap();
        let (engine, fake) = engine_with_a_start_in_flight(home.path()).await;
        let id = TaskId::new("t1").unwrap();
        let down = EngineShutdown::new(engine.clone(), Duration::from_secs(30));
        let first_ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drain = down.drain({
            let (first_ran, engine, id) = (first_ran.clone(), engine.clone(), id.clone());
            async move {
                assert!(
                    engine.is_starting(&id).unwrap(),
                    "the agent's part runs first"
                );
                first_ran.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let began = tokio::time::Instant::now();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            fake.release_starts();
        });
        drain.await;
        assert!(first_ran.load(std::sync::atomic::Ordering::SeqCst));
        assert!(
            began.elapsed() >= Duration::from_secs(5),
            "the start was waited for"
        );
        assert_eq!(engine.task_info(&id).unwrap().status, TaskStatus::Running);
        release.await.unwrap();
        let finished = tokio::time::Instant::now();
        down.finish().await;
        assert!(
            finished.elapsed() < Duration::from_secs(1),
            "nothing left to do"
        );

        let home = tempfile::tempdir().unwrap();
        let (engine, _fake) = engine_with_a_start_in_flight(home.path()).await;
        let down = EngineShutdown::new(engine.clone(), Duration::from_secs(30));
        let began = tokio::time::Instant::now();
        down.drain(async {}).await;
        let waited = began.elapsed();
        assert!(
            waited >= Duration::from_secs(30) && waited < Duration::from_secs(41),
            "a start that never returns is left after the grace: {waited:?}"
        );
    }

    /// Cut short (a forced shutdown: the drain never ran), `finish` shuts the engine down at
    /// once, leaving the start in flight (its container keeps whatever state it has).
    #[tokio::test(start_paused = true)]
    async fn a_drain_cut_short_is_finished_at_once() {
        let home = tempfile::tempdir().unwrap();
        let (engine, _fake) = engine_with_a_start_in_flight(home.path()).await;
        let down = EngineShutdown::new(engine.clone(), Duration::from_secs(30));
        drop(down.drain(async {}));
        let began = tokio::time::Instant::now();
        down.finish().await;
        assert!(
            began.elapsed() < Duration::from_secs(11),
            "not the grace: {:?}",
            began.elapsed()
        );
        let id = TaskId::new("t1").unwrap();
        assert!(engine.is_starting(&id).unwrap(), "the start was left");
    }

    /// Issue 28 part 4: a task's GPUs as DCGM measures them, joined by the GPU ids the shim
    /// gave the task (the recorded 8×A800 payload has utilisation for its whole GPUs; memory
    /// and MIG instances are added here as the exporter writes them).
    #[test]
    fn task_gpus_join_dcgm_by_the_gpus_each_task_holds() {
        let recorded = fs_err::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../shim-dcgm/testdata/dcgm-exporter-8xA800-mig.prom"
        ))
        .unwrap();
        let whole = "GPU-9e5b8fec-61bf-5124-a0a9-079af1b65cc6";
        let mig = "GPU-mig-0";
        let text = format!(
            "{recorded}\n\
             # TYPE DCGM_FI_DEV_FB_USED gauge\n\
             DCGM_FI_DEV_FB_USED{{gpu=\"1\",UUID=\"{whole}\"}} 1024\n\
             DCGM_FI_DEV_GPU_UTIL{{gpu=\"9\",UUID=\"{mig}\",GPU_I_ID=\"1\"}} 30\n\
             DCGM_FI_DEV_GPU_UTIL{{gpu=\"9\",UUID=\"{mig}\",GPU_I_ID=\"2\"}} 50\n\
             DCGM_FI_DEV_FB_USED{{gpu=\"9\",UUID=\"{mig}\",GPU_I_ID=\"1\"}} 1\n\
             DCGM_FI_DEV_FB_USED{{gpu=\"9\",UUID=\"{mig}\",GPU_I_ID=\"2\"}} 2\n"
        );
        let tasks = vec![
            (
                "a".to_owned(),
                vec![whole.to_owned(), "GPU-unknown".to_owned()],
            ),
            ("b".to_owned(), vec![mig.to_owned()]),
        ];
        let joined = join_task_gpus(&text, &tasks);
        assert_eq!(
            joined,
            [
                TaskGpu {
                    task_id: "a".into(),
                    gpu: whole.into(),
                    utilization_percent: Some(0.0),
                    memory_used_bytes: Some(1024.0 * 1_048_576.0),
                },
                TaskGpu {
                    task_id: "b".into(),
                    gpu: mig.into(),
                    utilization_percent: Some(40.0),
                    memory_used_bytes: Some(3.0 * 1_048_576.0),
                },
            ]
        );

        let gpus = Arc::new(TaskGpus::default());
        *gpus.lock() = joined;
        let mut registry = Registry::default();
        registry.register_collector(Box::new(TaskGpusCollector(gpus)));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            format!(r#"dstack_shim_task_gpu_utilization_percent{{task_id="a",gpu="{whole}"}} 0.0"#),
            format!(r#"dstack_shim_task_gpu_utilization_percent{{task_id="b",gpu="{mig}"}} 40.0"#),
            format!(
                r#"dstack_shim_task_gpu_memory_used_bytes{{task_id="a",gpu="{whole}"}} 1073741824.0"#
            ),
            "# TYPE dstack_shim_task_gpu_memory_used_bytes gauge".to_owned(),
        ] {
            assert!(text.contains(&line), "{line} in:\n{text}");
        }
        assert!(join_task_gpus(&text, &[]).is_empty());
    }

    #[test]
    fn readiness_is_the_engines_verdict_and_reasons() {
        let ok = readiness(&shim_engine::EngineHealth::new(
            true,
            Some(Duration::from_secs(1)),
            Duration::from_secs(300),
        ));
        assert!(ok.ready);
        assert!(ok.reasons.is_empty());
        assert_eq!(ok.events_connected, Some(true));
        assert_eq!(ok.last_reconcile_age_seconds, Some(1.0));
        assert_eq!(ok.reconcile_max_age_seconds, Some(600.0));

        let health = shim_engine::EngineHealth::new(false, None, Duration::from_secs(300));
        let r = readiness(&health);
        assert!(!r.ready);
        assert_eq!(r.reasons, health.reasons());
        assert_eq!(r.reasons.len(), 2);
        assert_eq!(r.last_reconcile_age_seconds, None);
    }
}
