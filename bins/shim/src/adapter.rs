//! The HTTP layer's view of the engine: [`ShimApi`] implemented over [`Engine`], with engine
//! errors mapped to API error kinds (the status codes themselves are chosen in `shim-http`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use shim_engine::{Engine, EngineError};
use shim_http::{ApiError, InstanceInfo, ShimApi};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};

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

/// An error with its whole cause chain: what the client and the log see.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
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

    async fn instance_health(&self) -> serde_json::Value {
        // Without DCGM, GPU health is unknown, which the server reads from `{}`.
        match &self.dcgm.health {
            Some(h) => serde_json::to_value(h.instance_health().await)
                .unwrap_or_else(|_| serde_json::json!({})),
            None => serde_json::json!({}),
        }
    }

    /// As upstream (`runner/internal/shim/api/handlers.go`, `TaskMetricsHandler`): no
    /// exporter is 404 before the task is looked up; an exporter failure is 502.
    async fn task_metrics(&self, id: &TaskId) -> Result<String, ApiError> {
        let Some(exporter) = &self.dcgm.exporter else {
            return Err(ApiError::not_found("DCGM Exporter is not available"));
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
}
