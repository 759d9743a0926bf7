//! The seams of the HTTP layer: the traits the engine and the component installer implement,
//! the wire types they exchange (the component types are `shim_components`' own), and
//! [`ApiError`], whose [`ErrorKind`] alone picks the status code (see [`ErrorKind::status`]).

use async_trait::async_trait;
use http::StatusCode;
use serde::{Deserialize, Serialize};
use shim_components::{ComponentInfo, ComponentName};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};

/// What went wrong with a request; decides the HTTP status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// 400: the request is malformed or a field is invalid.
    BadRequest,
    /// 404: no such task / route / exporter.
    NotFound,
    /// 405: the path exists, the method does not.
    MethodNotAllowed,
    /// 409: the request conflicts with the current state (id already known, task not
    /// terminated, component already installing).
    Conflict,
    /// 408: the request's body did not come whole within
    /// [`crate::ConnectionLimits::body_read_timeout`].
    RequestTimeout,
    /// 413: the body is larger than [`crate::MAX_BODY_BYTES`].
    PayloadTooLarge,
    /// 415: the body is not `application/json`.
    UnsupportedMediaType,
    /// 500: the shim failed to do what it was asked.
    Internal,
    /// 502: an upstream the shim relies on (the metrics exporter) failed.
    BadGateway,
    /// 503: the shim is not ready to do this (yet).
    Unavailable,
}

impl ErrorKind {
    /// The one place where an error becomes a status code.
    pub fn status(self) -> StatusCode {
        match self {
            Self::BadRequest => StatusCode::BAD_REQUEST,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict => StatusCode::CONFLICT,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::BadGateway => StatusCode::BAD_GATEWAY,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// An error answered to an API client: a kind (the status code) and a readable message (the
/// `text/plain` body). The optional cause is logged, never sent.
///
/// It is an answer, not a link in an error chain: the message is what the client may know
/// (upstream's text replacing the engine's, or, for a 500, the cause's own text with its
/// causes), so the cause is not its `source()`: a reporter walking sources would print the
/// cause's text twice. The server logs the cause beside the message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
#[non_exhaustive]
pub struct ApiError {
    /// Decides the status code.
    pub kind: ErrorKind,
    /// The response body.
    pub message: String,
    /// The underlying error, for the log ([`ApiError::with_source`]).
    pub cause: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl ApiError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            cause: None,
        }
    }

    /// Attaches the underlying error as the cause (logged, not sent).
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Box::new(source));
        self
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// 409.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// 502.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadGateway, message)
    }

    /// 503.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// The status code this error is answered with.
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }
}

/// `GET /api/instance/info`: fields are omitted when unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceInfo {
    /// `nvidia`, `amd`, `tenstorrent`, `intel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_vendor: Option<String>,
    /// The GPU driver version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_driver_version: Option<String>,
}

/// Body of `POST /api/tasks/{id}/terminate`. Every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct TerminateRequest {
    /// Stored as given; `""` when absent.
    #[serde(deserialize_with = "null_default")]
    pub termination_reason: String,
    /// Stored as given; `""` when absent.
    #[serde(deserialize_with = "null_default")]
    pub termination_message: String,
    /// Seconds Docker waits after SIGTERM before SIGKILL; `0` kills at once.
    #[serde(deserialize_with = "null_default")]
    pub timeout: u64,
}

/// Body of `POST /api/shutdown`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct ShutdownRequest {
    /// Close at once instead of draining in-flight requests and background jobs.
    #[serde(default, deserialize_with = "null_default")]
    pub force: bool,
}

/// Body of `POST /api/components/install`. Names are checked by the handler (an unknown name
/// is a 400 with a readable message, not a deserialization error).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct InstallRequest {
    /// `dstack-runner` or `dstack-shim`.
    #[serde(default, deserialize_with = "null_default")]
    pub name: String,
    /// Where to download the binary from.
    #[serde(default, deserialize_with = "null_default")]
    pub url: String,
}

fn null_default<'de, D: serde::Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// What the HTTP layer needs from the engine. `shim-engine` knows nothing of HTTP:
/// `EngineApi` (feature `engine`) implements this over its `Engine`, mapping engine errors to
/// [`ErrorKind`]s; tests implement it with fakes. Every method is called from a
/// request handler, so none may block.
#[async_trait]
pub trait ShimApi: Send + Sync + 'static {
    /// Validated config in, `pending` TaskInfo out once the task is persisted.
    /// Errors: `Conflict` when the id is already known, `Internal` otherwise.
    async fn submit(&self, config: TaskConfig) -> Result<TaskInfo, ApiError>;
    /// One task. `NotFound` when unknown (answered with upstream's message, whatever this
    /// error's).
    async fn task_info(&self, id: &TaskId) -> Result<TaskInfo, ApiError>;
    /// Every known task, terminated included.
    async fn list_tasks(&self) -> Vec<(TaskId, TaskStatus)>;
    /// Terminates a task and answers its (now terminated) info. `NotFound`, `Conflict`,
    /// `Internal`.
    async fn terminate(
        &self,
        id: &TaskId,
        reason: TerminationReason,
        message: String,
        timeout_s: u64,
    ) -> Result<TaskInfo, ApiError>;
    /// Removes a terminated task. `NotFound`, `Conflict` (not terminated), `Internal`.
    async fn remove(&self, id: &TaskId) -> Result<(), ApiError>;
    /// GPU vendor and driver version, where known.
    async fn instance_info(&self) -> InstanceInfo;
    /// `{"dcgm": {...}}`, or `{"dcgm": null}` where GPU health is unknown (upstream's
    /// `InstanceHealthResponse`).
    async fn instance_health(&self) -> serde_json::Value;
    /// Prometheus text of the task's GPU metrics. `NotFound` when there is no such task (the
    /// handler answers upstream's `Task not found`), `BadGateway` when the exporter failed.
    async fn task_metrics(&self, id: &TaskId) -> Result<String, ApiError>;
    /// Whether there is an exporter for [`ShimApi::task_metrics`]: without one the handler
    /// answers upstream's 404 before it looks at the task (so a `NotFound` from
    /// `task_metrics` always means the task). The default: there is.
    fn has_task_metrics(&self) -> bool {
        true
    }

    /// Subscribes to task changes (`GET /api/events`): every change from now on, in order.
    /// The handler subscribes *before* it takes the snapshot ([`ShimApi::list_tasks`]), so
    /// no change falls between the two. The default: `NotFound` (no change feed).
    fn subscribe(&self) -> Result<Box<dyn ChangeFeed>, ApiError> {
        Err(ApiError::not_found("task change events are not available"))
    }

    /// The shim's own metrics (`GET /metrics`) in the OpenMetrics text format, ending with
    /// `# EOF`. The default: `NotFound` (no metrics).
    async fn metrics(&self) -> Result<String, ApiError> {
        Err(ApiError::not_found("metrics are not available"))
    }

    /// Whether the shim keeps up with the container runtime (`GET /api/ready`). The default:
    /// ready, with no details.
    async fn readiness(&self) -> Readiness {
        Readiness::ready()
    }
}

/// One task change as `GET /api/events` streams it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeEvent {
    /// The change's sequence number, strictly increasing across tasks (the SSE `id`).
    pub seq: u64,
    /// The change as one JSON object (the SSE `data`).
    pub json: String,
}

/// Why a [`ChangeFeed`] gave no change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    /// The subscriber fell behind and `missed` changes were dropped for it.
    #[error("fell behind: {missed} task changes were dropped")]
    Lagged {
        /// How many changes were dropped.
        missed: u64,
    },
    /// The producer is gone; no more changes will come.
    #[error("the change feed closed")]
    Closed,
}

/// A subscription to task changes ([`ShimApi::subscribe`]). The producer must never wait
/// for a subscriber: one that falls behind gets [`FeedError::Lagged`].
#[async_trait]
pub trait ChangeFeed: Send + 'static {
    /// The next change, in order. Must be cancel-safe: it is raced against timers and the
    /// client going away, and a change must not be lost when the future is dropped.
    async fn recv(&mut self) -> Result<ChangeEvent, FeedError>;
}

/// `GET /api/ready`: whether the shim keeps up with the container runtime. Answered 200 when
/// `ready`, else 503, with this body either way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Readiness {
    /// Ready: exits are seen as they happen and the last full view is recent.
    pub ready: bool,
    /// Why not ready (empty when ready), readable sentences.
    pub reasons: Vec<String>,
    /// Whether the container runtime's event stream is connected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_connected: Option<bool>,
    /// Seconds since the last successful full container list (absent before the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reconcile_age_seconds: Option<f64>,
    /// The largest age of the last full list at which the shim is still ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconcile_max_age_seconds: Option<f64>,
}

impl Readiness {
    /// Ready, with no details.
    pub fn ready() -> Self {
        Self::new(true, Vec::new())
    }

    /// Ready or not, with the reasons why not; no runtime details.
    pub fn new(ready: bool, reasons: Vec<String>) -> Self {
        Self {
            ready,
            reasons,
            events_connected: None,
            last_reconcile_age_seconds: None,
            reconcile_max_age_seconds: None,
        }
    }

    /// With the container runtime's details: whether its event stream is connected, the age
    /// of the last full list (if any) and the largest age at which the shim is still ready.
    #[must_use]
    pub fn with_runtime(
        mut self,
        events_connected: bool,
        last_reconcile_age_seconds: Option<f64>,
        reconcile_max_age_seconds: f64,
    ) -> Self {
        self.events_connected = Some(events_connected);
        self.last_reconcile_age_seconds = last_reconcile_age_seconds;
        self.reconcile_max_age_seconds = Some(reconcile_max_age_seconds);
        self
    }
}

/// What the HTTP layer needs from the component installer. `shim-components` knows nothing
/// of HTTP: `ComponentsHttp` (feature `components`) implements this over its `Components`,
/// mapping its errors to [`ErrorKind`]s; [`NoComponents`] is none; tests implement it with
/// fakes.
#[async_trait]
pub trait ComponentsApi: Send + Sync + 'static {
    /// The state of every component, runner first.
    async fn list(&self) -> Vec<ComponentInfo>;
    /// Starts installing `name` from `url` in the background and returns at once.
    /// `Conflict` when that component is already installing.
    async fn install(&self, name: ComponentName, url: String) -> Result<(), ApiError>;
}

/// No component installer: `GET /api/components` lists none, an install is a 400. For an
/// agent that installs nothing through the API.
pub struct NoComponents;

#[async_trait]
impl ComponentsApi for NoComponents {
    async fn list(&self) -> Vec<ComponentInfo> {
        Vec::new()
    }

    async fn install(&self, name: ComponentName, _url: String) -> Result<(), ApiError> {
        Err(ApiError::bad_request(format!(
            "{} cannot be installed through this agent",
            name.as_str()
        )))
    }
}
