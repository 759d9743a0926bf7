//! The engine's errors, the kind an API answers each with, and the one function that prints an
//! error with its causes.
//!
//! Every error's `Display` says what failed at its own level and never repeats its cause: the
//! cause is its [`source`](std::error::Error::source). [`chain`] prints the whole chain
//! (`what: why: why`), for logs and for the messages that carry the cause (API error bodies,
//! termination messages).

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
    #[error("task store")]
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
    #[error("container runtime")]
    Runtime(#[from] shim_runtime::RuntimeError),
    /// The container runtime could not be reached at start-up within the allowed time.
    #[error("container runtime not reachable at start-up")]
    RuntimeUnavailable(#[source] shim_runtime::RuntimeError),
    /// A background job panicked or was cancelled.
    #[error("background job failed")]
    Join(#[from] tokio::task::JoinError),
    /// The task is not in a status that allows the request.
    #[error("task {id} is {status}")]
    WrongStatus {
        /// The task.
        id: TaskId,
        /// Its status.
        status: TaskStatus,
    },
    /// The image the pull step found present was gone when the container was created: removed
    /// in between (an image prune). The task ends; it is never pulled outside the pull step.
    #[error(
        "image {image} was removed after the pull step found it (an image prune?) and before \
         the container was created"
    )]
    ImageVanished {
        /// The image.
        image: String,
    },
    /// A task's GPUs cannot be passed to its container here (see `GpuDeviceMode`): why, and
    /// what to do.
    #[error("{message}")]
    GpusUnavailable {
        /// Why, and what to do.
        message: String,
    },
    /// The engine was shut down ([`crate::Engine::shutdown`]): it starts, stops and removes
    /// nothing more, since nothing would watch the containers; its views still answer.
    #[error("the engine is shut down")]
    ShutDown,
}

/// How an API answers an [`EngineError`] ([`EngineError::kind`]): the one mapping every
/// embedder shares (an HTTP server picks its status codes from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No such task (HTTP 404).
    NotFound,
    /// The request conflicts with the task's state: its id is taken, it is not terminated,
    /// start or a release still holds it (HTTP 409).
    Conflict,
    /// The request itself is invalid: a config field (HTTP 400).
    InvalidInput,
    /// The engine failed to do what it was asked (HTTP 500).
    Internal,
}

impl EngineError {
    /// How an API answers this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::AlreadyExists(_) | Self::Conflict(_) | Self::WrongStatus { .. } => {
                ErrorKind::Conflict
            }
            Self::InvalidConfig(_) => ErrorKind::InvalidInput,
            Self::ReleaseIncomplete { .. }
            | Self::Store(_)
            | Self::StateWrite { .. }
            | Self::Runtime(_)
            | Self::RuntimeUnavailable(_)
            | Self::ImageVanished { .. }
            | Self::GpusUnavailable { .. }
            | Self::ShutDown
            | Self::Join(_) => ErrorKind::Internal,
        }
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// An error with its whole cause chain, as the API answers and the log show it (the workspace's
/// one reporter, [`shim_util::error_chain`]).
pub(crate) use shim_util::error_chain as chain;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn not_found() -> shim_runtime::RuntimeError {
        shim_runtime::RuntimeError::NotFound {
            what: "container c1".to_owned(),
        }
    }

    /// Each level says its own part once; the chain says it all.
    #[test]
    fn display_never_repeats_the_source_and_the_chain_says_it_all() {
        let cause = not_found();
        let e = EngineError::StateWrite {
            id: TaskId::new("t1").unwrap(),
            source: Box::new(EngineError::Runtime(not_found())),
        };
        let cause_text = cause.to_string();
        for level in [
            &e as &dyn std::error::Error,
            &EngineError::Runtime(not_found()),
            &EngineError::RuntimeUnavailable(not_found()),
        ] {
            shim_util::testing::assert_each_cause_once(level);
        }
        assert_eq!(
            chain(&e),
            format!("cannot write the state file of task t1: container runtime: {cause_text}")
        );
    }

    #[test]
    fn kinds() {
        let id = || TaskId::new("t1").unwrap();
        assert_eq!(EngineError::NotFound(id()).kind(), ErrorKind::NotFound);
        assert_eq!(EngineError::AlreadyExists(id()).kind(), ErrorKind::Conflict);
        assert_eq!(
            EngineError::Conflict(TransitionError::StartInFlight { id: id() }).kind(),
            ErrorKind::Conflict
        );
        assert_eq!(
            EngineError::WrongStatus {
                id: id(),
                status: TaskStatus::Running
            }
            .kind(),
            ErrorKind::Conflict
        );
        assert_eq!(
            EngineError::InvalidConfig(ConfigError {
                field: "gpu".into(),
                why: "must be >= -1".into()
            })
            .kind(),
            ErrorKind::InvalidInput
        );
        assert_eq!(
            EngineError::Runtime(not_found()).kind(),
            ErrorKind::Internal
        );
    }
}
