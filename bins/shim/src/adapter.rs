//! The HTTP layer's view of the engine: [`ShimApi`] implemented over [`Engine`], with engine
//! errors mapped to API error kinds (the status codes themselves are chosen in `shim-http`).

use std::time::Duration;

use async_trait::async_trait;
use shim_engine::{Engine, EngineError};
use shim_http::{ApiError, InstanceInfo, ShimApi};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};

/// The engine behind the API.
pub struct EngineApi {
    engine: Engine,
}

impl EngineApi {
    pub fn new(engine: Engine) -> Self {
        Self { engine }
    }
}

fn api_error(e: EngineError) -> ApiError {
    let message = e.to_string();
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
        // No DCGM integration: GPU health is unknown, which the server reads from `{}`.
        serde_json::json!({})
    }

    async fn task_metrics(&self, id: &TaskId) -> Result<String, ApiError> {
        self.engine.task_info(id).map_err(api_error)?;
        Err(ApiError::not_found("no GPU metrics exporter on this host"))
    }
}
