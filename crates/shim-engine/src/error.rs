//! The engine's errors.

use shim_task::{ConfigError, TaskId, TaskStatus, machine::TransitionError};

/// What went wrong in an engine operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// No task with this id.
    #[error("task {0} not found")]
    NotFound(TaskId),
    /// A task with this id already exists (in memory or on disk).
    #[error("task {0} already exists")]
    AlreadyExists(TaskId),
    /// The config is invalid.
    #[error(transparent)]
    InvalidConfig(#[from] ConfigError),
    /// The state machine refused the request (e.g. remove of a running task).
    #[error(transparent)]
    Conflict(#[from] TransitionError),
    /// Remove could not release everything the task holds; the task is kept and a later remove
    /// (or the reconciler) retries.
    #[error("task {id} still holds resources after release: {message}")]
    ReleaseIncomplete {
        /// The task.
        id: TaskId,
        /// What is still held.
        message: String,
    },
    /// The task store failed.
    #[error("task store: {0}")]
    Store(#[from] shim_store::StoreError),
    /// A task's state file could not be written (e.g. a full disk). The task keeps the change
    /// in memory, shows its last durable state, and the reconciler retries the write; what
    /// ends the task (a stop, a release) went out all the same.
    #[error("cannot write the state file of task {id}")]
    StateWrite {
        /// The task.
        id: TaskId,
        /// Why.
        #[source]
        source: Box<EngineError>,
    },
    /// The container runtime failed.
    #[error("container runtime: {0}")]
    Runtime(#[from] shim_runtime::RuntimeError),
    /// The container runtime could not be reached at start-up within the allowed time.
    #[error("container runtime not reachable at start-up: {0}")]
    RuntimeUnavailable(#[source] shim_runtime::RuntimeError),
    /// A background job panicked or was cancelled.
    #[error("background job failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// The task is not in a status that allows the request.
    #[error("task {id} is {status}")]
    WrongStatus {
        /// The task.
        id: TaskId,
        /// Its status.
        status: TaskStatus,
    },
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
