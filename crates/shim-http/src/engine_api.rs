//! The engine behind the API (feature `engine`): [`ShimApi`] implemented over
//! `shim_engine::Engine`, so an agent that embeds the engine serves dstack's API in a few
//! lines. The engine's error kinds become API error kinds (the status codes themselves are
//! chosen in [`ErrorKind::status`](crate::ErrorKind::status)); its task changes are the change
//! feed (`GET /api/events`), its metrics with the build info in one registry (`GET /metrics`),
//! its health the readiness (`GET /api/ready`); DCGM, where it runs, answers the instance's
//! GPU health and a task's GPU metrics.
//!
//! ```no_run
//! # async fn f(engine: shim_engine::Engine) -> Result<(), shim_http::Error> {
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
use shim_engine::{
    Engine, EngineError, ErrorKind, Subscription, SubscriptionError, error_chain as chain,
};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};

use crate::{ApiError, ChangeEvent, ChangeFeed, FeedError, InstanceInfo, Readiness, ShimApi};

/// The engine behind the API, and DCGM where it runs.
pub struct EngineApi {
    engine: Engine,
    dcgm: Option<Arc<shim_dcgm::Dcgm>>,
    /// The engine's metrics and the build info.
    registry: Registry,
}

impl EngineApi {
    /// The API over `engine`; `version` is the build's, served as
    /// `dstack_shim_build_info{version}` in `GET /metrics`. Without DCGM
    /// ([`EngineApi::with_dcgm`]) GPU health is unknown and a task's GPU metrics are 404.
    pub fn new(engine: Engine, version: &str) -> Self {
        let registry = metrics_registry(&engine, version);
        Self {
            engine,
            dcgm: None,
            registry,
        }
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
    /// without DCGM, or when it fails, GPU health is unknown: `{"dcgm":null}`.
    async fn instance_health(&self) -> serde_json::Value {
        let health = match self.dcgm.as_ref().and_then(|d| d.health.as_ref()) {
            Some(h) => h.instance_health().await,
            None => shim_dcgm::InstanceHealth::default(),
        };
        // Plain data: encoding cannot fail; were it to, the answer is still "unknown".
        serde_json::to_value(health).unwrap_or_else(|_| serde_json::json!({ "dcgm": null }))
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
        let mut text = String::new();
        encode(&mut text, &self.registry)
            .map_err(|e| ApiError::internal(format!("cannot encode the metrics: {e}")))?;
        Ok(text)
    }

    async fn readiness(&self) -> Readiness {
        readiness(&self.engine.health())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
