//! A placeholder engine: answers 503 for every task route until the real engine is wired in
//! `main.rs`. It lets the binary, the CLI, logging, signals, components and the HTTP server be
//! exercised on their own.

use async_trait::async_trait;
use shim_http::{ApiError, InstanceInfo, ShimApi};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};

/// The placeholder engine.
pub struct Unwired;

fn unavailable() -> ApiError {
    ApiError::unavailable("the task engine is not wired into this build")
}

#[async_trait]
impl ShimApi for Unwired {
    async fn submit(&self, _config: TaskConfig) -> Result<TaskInfo, ApiError> {
        Err(unavailable())
    }

    async fn task_info(&self, _id: &TaskId) -> Result<TaskInfo, ApiError> {
        Err(unavailable())
    }

    async fn list_tasks(&self) -> Vec<(TaskId, TaskStatus)> {
        Vec::new()
    }

    async fn terminate(
        &self,
        _id: &TaskId,
        _reason: TerminationReason,
        _message: String,
        _timeout_s: u64,
    ) -> Result<TaskInfo, ApiError> {
        Err(unavailable())
    }

    async fn remove(&self, _id: &TaskId) -> Result<(), ApiError> {
        Err(unavailable())
    }

    async fn instance_info(&self) -> InstanceInfo {
        InstanceInfo::default()
    }

    async fn instance_health(&self) -> serde_json::Value {
        serde_json::json!({})
    }

    async fn task_metrics(&self, _id: &TaskId) -> Result<String, ApiError> {
        Err(ApiError::not_found("no metrics exporter"))
    }
}
