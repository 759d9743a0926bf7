//! The HTTP layer's view of the engine: [`ShimApi`] implemented over [`Engine`], with engine
//! errors mapped to API error kinds (the status codes themselves are chosen in `shim-http`);
//! the engine's task changes as the API's change feed (`GET /api/events`), its metrics with
//! the binary's build info (`GET /metrics`) and its health as readiness (`GET /api/ready`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use shim_engine::{Engine, EngineError, Subscription, SubscriptionError, error_chain as chain};
use shim_http::{ApiError, ChangeEvent, ChangeFeed, FeedError, InstanceInfo, Readiness, ShimApi};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};

use crate::config::VERSION;

/// The engine behind the API, and DCGM on NVIDIA hosts.
pub struct EngineApi {
    engine: Engine,
    dcgm: Arc<shim_dcgm::Dcgm>,
}

impl EngineApi {
    pub fn new(engine: Engine, dcgm: Arc<shim_dcgm::Dcgm>) -> Self {
        Self { engine, dcgm }
    }
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
                Err(SubscriptionError::Closed) => return Err(FeedError::Closed),
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

/// `# HELP`, `# TYPE` and the sample of the binary's build info, in OpenMetrics' `info`
/// type (Prometheus reads it as a gauge of 1).
fn build_info(version: &str) -> String {
    let escaped = version
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    format!(
        "# HELP dstack_shim_build The dstack-shim binary's version.\n\
         # TYPE dstack_shim_build info\n\
         dstack_shim_build_info{{version=\"{escaped}\"}} 1\n"
    )
}

/// The engine's metrics with the binary's build info, one OpenMetrics exposition ending in
/// `# EOF`.
fn metrics_text(engine: &Engine) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    engine.encode_metrics(&mut text)?;
    let body_len = text.strip_suffix("# EOF\n").map_or(text.len(), str::len);
    text.truncate(body_len);
    text.push_str(&build_info(VERSION));
    text.push_str("# EOF\n");
    Ok(text)
}

/// The engine's health as the API's readiness, with the reasons spelled out.
fn readiness(health: &shim_engine::EngineHealth) -> Readiness {
    let max_age = health.backstop.saturating_mul(2);
    let mut reasons = Vec::new();
    if !health.events_connected {
        reasons.push("Docker's event stream is disconnected".to_owned());
    }
    match health.last_cycle_age {
        None => reasons.push("no full container list has succeeded yet".to_owned()),
        Some(age) if age > max_age => reasons.push(format!(
            "the last successful full container list was {:.1}s ago (more than {:.1}s)",
            age.as_secs_f64(),
            max_age.as_secs_f64()
        )),
        Some(_) => {}
    }
    let ready = health.is_ready();
    if !ready && reasons.is_empty() {
        reasons.push("the engine is not keeping up with Docker".to_owned());
    }
    if ready {
        reasons.clear();
    }
    Readiness {
        ready,
        reasons,
        events_connected: Some(health.events_connected),
        last_reconcile_age_seconds: health.last_cycle_age.map(|a| a.as_secs_f64()),
        reconcile_max_age_seconds: Some(max_age.as_secs_f64()),
    }
}

fn api_error(e: EngineError) -> ApiError {
    let message = chain(&e);
    match e {
        EngineError::NotFound(_) => ApiError::not_found(message),
        EngineError::AlreadyExists(_)
        | EngineError::Conflict(_)
        | EngineError::WrongStatus { .. } => ApiError::conflict(message),
        EngineError::InvalidConfig(_) => ApiError::bad_request(message),
        other => ApiError::internal(message).with_source(other),
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
        let unknown = || serde_json::json!({ "dcgm": null });
        match &self.dcgm.health {
            Some(h) => {
                serde_json::to_value(h.instance_health().await).unwrap_or_else(|_| unknown())
            }
            None => unknown(),
        }
    }

    /// As upstream (`runner/internal/shim/api/handlers.go`, `TaskMetricsHandler`): no
    /// exporter is 404 before the task is looked up; an exporter failure is 502.
    async fn task_metrics(&self, id: &TaskId) -> Result<String, ApiError> {
        let Some(exporter) = &self.dcgm.exporter else {
            return Err(ApiError::not_found("DCGM Exporter is not available"));
        };
        let info = self.engine.task_info(id).map_err(|e| match e {
            EngineError::NotFound(_) => ApiError::not_found("Task not found").with_source(e),
            other => api_error(other),
        })?;
        exporter
            .fetch_task_metrics(&info.gpu_ids.unwrap_or_default())
            .await
            .map_err(|e| match e.kind() {
                shim_dcgm::DcgmErrorKind::Upstream => ApiError::bad_gateway(chain(&e)),
                shim_dcgm::DcgmErrorKind::Internal => ApiError::internal(chain(&e)),
            })
    }

    fn has_task_metrics(&self) -> bool {
        self.dcgm.exporter.is_some()
    }

    fn subscribe(&self) -> Result<Box<dyn ChangeFeed>, ApiError> {
        Ok(Box::new(EngineFeed(self.engine.subscribe())))
    }

    async fn metrics(&self) -> Result<String, ApiError> {
        metrics_text(&self.engine)
            .map_err(|e| ApiError::internal(format!("cannot encode the metrics: {e}")))
    }

    async fn readiness(&self) -> Readiness {
        readiness(&self.engine.health())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shim_engine::EngineHealth;

    fn health(events: bool, age_s: Option<u64>) -> EngineHealth {
        EngineHealth {
            events_connected: events,
            last_cycle_age: age_s.map(Duration::from_secs),
            backstop: Duration::from_secs(300),
        }
    }

    #[test]
    fn readiness_spells_out_the_reasons() {
        let ok = readiness(&health(true, Some(1)));
        assert!(ok.ready);
        assert!(ok.reasons.is_empty());
        assert_eq!(ok.events_connected, Some(true));
        assert_eq!(ok.last_reconcile_age_seconds, Some(1.0));
        assert_eq!(ok.reconcile_max_age_seconds, Some(600.0));

        let r = readiness(&health(false, None));
        assert!(!r.ready);
        assert_eq!(
            r.reasons,
            [
                "Docker's event stream is disconnected",
                "no full container list has succeeded yet"
            ]
        );
        assert_eq!(r.last_reconcile_age_seconds, None);

        let r = readiness(&health(true, Some(601)));
        assert!(!r.ready);
        assert_eq!(
            r.reasons,
            ["the last successful full container list was 601.0s ago (more than 600.0s)"]
        );
        // At the limit it is still ready, as the engine says.
        assert!(readiness(&health(true, Some(600))).ready);
    }

    #[test]
    fn build_info_is_one_escaped_info_sample() {
        assert_eq!(
            build_info("1.2\"x\\"),
            "# HELP dstack_shim_build The dstack-shim binary's version.\n\
             # TYPE dstack_shim_build info\n\
             dstack_shim_build_info{version=\"1.2\\\"x\\\\\"} 1\n"
        );
    }
}
