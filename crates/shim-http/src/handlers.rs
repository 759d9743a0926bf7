//! Request handling: route, parse, call the engine, answer — with upstream's answers
//! (`runner/internal/shim/api/handlers.go`, `runner/internal/common/api/api.go`): JSON as
//! Go's encoder writes it (`gojson`), errors and empty answers as Go's `http.Error` writes
//! them (`text/plain; charset=utf-8`, `X-Content-Type-Options: nosniff`, the message and a
//! newline), upstream's messages for unknown tasks, routes and methods.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE, X_CONTENT_TYPE_OPTIONS};
use http::{Request, Response, StatusCode};
use hyper::body::Body;
use serde::Serialize;
use shim_components::{ComponentInfo, ComponentName};
use shim_task::{PortMapping, PullProgress, TaskConfig, TaskId, TaskInfo, TerminationReason};
use shim_util::error_chain;
use tokio_util::sync::CancellationToken;

use crate::api::ErrorKind;
use crate::api::{
    ApiError, ComponentsApi, InstallRequest, ShimApi, ShutdownRequest, TerminateRequest,
};
use crate::body::{ResponseBody, parse_json, read_body, read_json};
use crate::events::{self, ConnectionClose, EventsHub};
use crate::gojson;
use crate::routes::{self, MethodNotAllowed, RouteId};

/// The content type of `GET /metrics`: the OpenMetrics text format, which Prometheus
/// negotiates first and `prometheus-client` writes.
pub(crate) const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Everything a handler may touch.
pub(crate) struct State {
    pub api: Arc<dyn ShimApi>,
    pub components: Arc<dyn ComponentsApi>,
    pub version: String,
    /// Graceful shutdown: stop accepting, drain.
    pub shutdown: CancellationToken,
    /// Forced shutdown: close at once.
    pub force: CancellationToken,
    /// Decides what `POST /api/shutdown` does instead of cancelling the tokens.
    pub on_shutdown: Option<crate::ShutdownHook>,
    /// The event streams (`GET /api/events`).
    pub events: EventsHub,
}

#[derive(Serialize)]
struct Healthcheck<'a> {
    service: &'static str,
    version: &'a str,
}

#[derive(Serialize)]
struct TaskListItem {
    id: TaskId,
    status: shim_task::TaskStatus,
}

#[derive(Serialize)]
struct TaskList {
    tasks: Vec<TaskListItem>,
}

#[derive(Serialize)]
struct ComponentList {
    components: Vec<ComponentInfo>,
}

/// Answers one request. Never fails: errors become `text/plain` responses.
pub(crate) async fn handle<B>(state: Arc<State>, req: Request<B>) -> Response<ResponseBody>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    match dispatch(&state, req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            // A read at trace, as upstream logs every served request: the server polls each
            // instance every few seconds, at debug. What changes something is at debug.
            if method == hyper::Method::GET || method == hyper::Method::HEAD {
                tracing::trace!(%method, %path, status, "request");
            } else {
                tracing::debug!(%method, %path, status, "request");
            }
            resp
        }
        Err(err) => {
            let status = err.status();
            if status.is_server_error() {
                let cause = err.cause.as_deref().map(|c| error_chain(c));
                tracing::error!(%method, %path, status = status.as_u16(), error = %err,
                    cause = cause.as_deref().unwrap_or_default(), "request failed");
            } else {
                tracing::debug!(%method, %path, status = status.as_u16(), error = %err, "request refused");
            }
            error_response(&err)
        }
    }
}

/// The response for an error, as Go's `http.Error` writes it (upstream's handlers answer
/// every error so): its status, `text/plain; charset=utf-8`, `X-Content-Type-Options:
/// nosniff`, the message and a newline; `Allow` for 405.
pub(crate) fn error_response(err: &ApiError) -> Response<ResponseBody> {
    let mut resp = go_error(err.status(), &err.message);
    if let Some(allowed) = err
        .cause
        .as_deref()
        .and_then(|s| s.downcast_ref::<MethodNotAllowed>())
        && let Ok(value) = http::HeaderValue::from_str(&allowed.allowed.join(", "))
    {
        resp.headers_mut().insert(ALLOW, value);
    }
    resp
}

/// Go's `http.Error(w, message, status)`: also what upstream answers with for a handler that
/// returns no body (`JSONResponseHandler` with a nil body: 200 and a lone newline).
fn go_error(status: StatusCode, message: &str) -> Response<ResponseBody> {
    let mut body = String::with_capacity(message.len() + 1);
    body.push_str(message);
    body.push('\n');
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/plain; charset=utf-8")
        .header(X_CONTENT_TYPE_OPTIONS, "nosniff")
        .body(ResponseBody::new(body))
        .unwrap_or_else(|_| fallback())
}

fn fallback() -> Response<ResponseBody> {
    let mut resp = Response::new(ResponseBody::new("failed to build the response"));
    *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    resp
}

fn json<T: Serialize>(value: &T) -> Result<Response<ResponseBody>, ApiError> {
    let body = gojson::to_vec(value)
        .map_err(|e| ApiError::internal(format!("failed to encode the response: {e}")))?;
    Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, "application/json")
        .body(ResponseBody::new(body))
        .map_err(|e| ApiError::internal(format!("failed to build the response: {e}")))
}

fn build(
    builder: http::response::Builder,
    body: ResponseBody,
) -> Result<Response<ResponseBody>, ApiError> {
    builder
        .body(body)
        .map_err(|e| ApiError::internal(format!("failed to build the response: {e}")))
}

async fn task_list(api: &dyn ShimApi) -> TaskList {
    let tasks = api
        .list_tasks()
        .await
        .into_iter()
        .map(|(id, status)| TaskListItem { id, status })
        .collect();
    TaskList { tasks }
}

/// Go's `http.ServeMux` answer to a path that is not canonical (`//api/tasks`,
/// `/api/./tasks`): `307 Temporary Redirect` to the clean path, with Go's `http.Redirect`
/// body for `GET` (an HTML link, and a newline after it) and type for `GET` and `HEAD`.
fn redirect(method: &http::Method, clean: &str, query: Option<&str>) -> Response<ResponseBody> {
    let mut location = clean.to_owned();
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        location.push('?');
        location.push_str(q);
    }
    let mut builder = Response::builder()
        .status(StatusCode::TEMPORARY_REDIRECT)
        .header(http::header::LOCATION, &location);
    let mut body = String::new();
    if method == http::Method::GET || method == http::Method::HEAD {
        builder = builder.header(CONTENT_TYPE, "text/html; charset=utf-8");
    }
    if method == http::Method::GET {
        let href = location
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&#34;")
            .replace('\'', "&#39;");
        body = format!("<a href=\"{href}\">Temporary Redirect</a>.\n\n");
    }
    builder
        .body(ResponseBody::new(body))
        .unwrap_or_else(|_| fallback())
}

/// Upstream's answer of a handler that returns no body (shutdown, remove, install).
fn empty_ok() -> Result<Response<ResponseBody>, ApiError> {
    Ok(go_error(StatusCode::OK, ""))
}

/// A task id from the path. One that is not a valid id names no task: upstream (which does
/// not validate ids) answers such a request as for an unknown task ([`upstream_reply`] gives
/// it the route's words).
fn task_id(raw: Option<&str>) -> Result<TaskId, ApiError> {
    TaskId::new(raw.unwrap_or_default())
        .map_err(|e| ApiError::not_found("not a task id").with_source(e))
}

/// What upstream answers when DCGM's exporter is not there (`TaskMetricsHandler`).
const NO_EXPORTER: &str = "DCGM Exporter is not available";

/// The one place an error's answer is built: upstream's words for an error of `route`
/// (`runner/internal/shim/api/handlers.go` and its runner's errors), the error kept as the
/// cause; any other error as it is.
///
/// | route | kind | upstream's words |
/// |---|---|---|
/// | `GET /api/tasks/{id}` | not found | `Not Found` |
/// | `POST /api/tasks/{id}/terminate`, `…/remove` | not found | `task <id>: not found` (its `TaskRunner` error) |
/// | `GET /metrics/tasks/{id}` | not found (the task) | `Task not found` |
/// | `POST /api/components/install` | conflict | `already installing` |
fn upstream_reply(route: RouteId, id: Option<&str>, e: ApiError) -> ApiError {
    let words = match (route, e.kind) {
        (RouteId::TaskInfo, ErrorKind::NotFound) => "Not Found".to_owned(),
        (RouteId::TaskTerminate | RouteId::TaskRemove, ErrorKind::NotFound) => {
            format!("task {}: not found", id.unwrap_or_default())
        }
        (RouteId::TaskMetrics, ErrorKind::NotFound) if e.message != NO_EXPORTER => {
            "Task not found".to_owned()
        }
        (RouteId::ComponentInstall, ErrorKind::Conflict) => "already installing".to_owned(),
        _ => return e,
    };
    ApiError::new(e.kind, words).with_source(e)
}

/// The submit answer: upstream's handler returns its runner's `shim.TaskInfo`, which has no
/// JSON tags, so Go writes its field names (`{"ID":..,"Status":..,"GpuIDs":..}`), unlike
/// every other TaskInfo answer. The dstack server does not read it.
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct SubmitAnswer<'a> {
    #[serde(rename = "ID")]
    id: &'a TaskId,
    status: shim_task::TaskStatus,
    termination_reason: &'a str,
    termination_message: &'a str,
    ports: Option<&'a [PortMapping]>,
    image_pull_progress: Option<&'a PullProgress>,
    container_name: &'a str,
    #[serde(rename = "ContainerID")]
    container_id: &'a str,
    #[serde(rename = "GpuIDs")]
    gpu_ids: Option<&'a [String]>,
}

impl<'a> From<&'a TaskInfo> for SubmitAnswer<'a> {
    fn from(i: &'a TaskInfo) -> Self {
        Self {
            id: &i.id,
            status: i.status,
            termination_reason: &i.termination_reason,
            termination_message: &i.termination_message,
            ports: i.ports.as_deref(),
            image_pull_progress: i.image_pull_progress.as_ref(),
            container_name: &i.container_name,
            container_id: &i.container_id,
            gpu_ids: i.gpu_ids.as_deref(),
        }
    }
}

/// Upstream's refusals of a submit body without `id`, `name` or `image_name` (`empty id`,
/// `empty name`, `empty image_name`, checked in that order once the body decoded), for a body
/// this shim could not read as a task config: a missing or empty id or name is what it could
/// not read then.
fn missing_required(bytes: &[u8]) -> Option<ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let empty = |field: &str| match &value {
        serde_json::Value::Null => true,
        serde_json::Value::Object(o) => {
            matches!(o.get(field), None | Some(serde_json::Value::Null))
                || o.get(field).and_then(serde_json::Value::as_str) == Some("")
        }
        _ => false,
    };
    ["id", "name", "image_name"]
        .into_iter()
        .find(|f| empty(f))
        .map(|f| ApiError::bad_request(format!("empty {f}")))
}

async fn dispatch<B>(state: &State, req: Request<B>) -> Result<Response<ResponseBody>, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let path = req.uri().path().to_owned();
    if req.method() != http::Method::CONNECT {
        let clean = routes::clean_path(&path);
        if clean != path {
            return Ok(redirect(req.method(), &clean, req.uri().query()));
        }
    }
    let resolved = routes::resolve(req.method().as_str(), &path)?;
    let (route, id) = (resolved.route, resolved.id.clone());
    answer(state, resolved, req)
        .await
        .map_err(|e| upstream_reply(route, id.as_deref(), e))
}

/// The answer of a resolved route (its errors get upstream's words in [`dispatch`]).
async fn answer<B>(
    state: &State,
    resolved: routes::Resolved,
    req: Request<B>,
) -> Result<Response<ResponseBody>, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match resolved.route {
        RouteId::Healthcheck => json(&Healthcheck {
            service: "dstack-shim",
            version: &state.version,
        }),
        RouteId::Shutdown => {
            let request: ShutdownRequest = read_json(req).await?;
            let shutdown = state.shutdown.clone();
            let force = state.force.clone();
            let hook = state.on_shutdown.clone();
            tracing::info!(force = request.force, "shutdown requested over the API");
            // Start the shutdown only once this 200 has been handed to the connection.
            let (parts, body) = go_error(StatusCode::OK, "").into_parts();
            let body = body.on_done(move || {
                if let Some(hook) = hook {
                    return hook(request);
                }
                if request.force {
                    force.cancel();
                }
                shutdown.cancel();
            });
            Ok(Response::from_parts(parts, body))
        }
        RouteId::InstanceHealth => json(&state.api.instance_health().await),
        RouteId::InstanceInfo => json(&state.api.instance_info().await),
        RouteId::ComponentList => json(&ComponentList {
            components: state.components.list().await,
        }),
        RouteId::ComponentInstall => {
            let body: InstallRequest = read_json(req).await?;
            if body.name.is_empty() {
                return Err(ApiError::bad_request("empty name"));
            }
            let name = ComponentName::parse(&body.name)
                .ok_or_else(|| ApiError::bad_request("unknown component"))?;
            if body.url.is_empty() {
                return Err(ApiError::bad_request("empty url"));
            }
            state.components.install(name, body.url).await?;
            empty_ok()
        }
        RouteId::TaskList => json(&task_list(state.api.as_ref()).await),
        RouteId::TaskSubmit => {
            let bytes = read_body(req).await?;
            let config: TaskConfig =
                parse_json(&bytes).map_err(|e| missing_required(&bytes).unwrap_or(e))?;
            if config.image_name.is_empty() {
                return Err(ApiError::bad_request("empty image_name"));
            }
            config
                .validate()
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let info = state.api.submit(config).await?;
            json(&SubmitAnswer::from(&info))
        }
        RouteId::TaskInfo => {
            let id = task_id(resolved.id.as_deref())?;
            json(&state.api.task_info(&id).await?)
        }
        RouteId::TaskTerminate => {
            // Upstream decodes the body before it looks for the task.
            let body: TerminateRequest = read_json(req).await?;
            let id = task_id(resolved.id.as_deref())?;
            let reason = TerminationReason::parse(&body.termination_reason);
            let info = state
                .api
                .terminate(&id, reason, body.termination_message, body.timeout)
                .await?;
            json(&info)
        }
        RouteId::TaskRemove => {
            let id = task_id(resolved.id.as_deref())?;
            state.api.remove(&id).await?;
            empty_ok()
        }
        RouteId::TaskMetrics => {
            // Upstream (`runner/internal/shim/api/handlers.go`, `TaskMetricsHandler`): the
            // exporter is checked before the task is looked up.
            if !state.api.has_task_metrics() {
                return Err(ApiError::not_found(NO_EXPORTER));
            }
            let id = task_id(resolved.id.as_deref())?;
            let text = state.api.task_metrics(&id).await?;
            // Upstream writes the text without a Content-Type, so Go sniffs one: plain text,
            // and none for an empty body.
            let mut builder = Response::builder().status(StatusCode::OK);
            if !text.is_empty() {
                builder = builder.header(CONTENT_TYPE, "text/plain; charset=utf-8");
            }
            build(builder, ResponseBody::new(text))
        }
        RouteId::Metrics => {
            let text = state.api.metrics().await?;
            build(
                Response::builder()
                    .status(StatusCode::OK)
                    .header(CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE),
                ResponseBody::new(text),
            )
        }
        RouteId::Ready => {
            let readiness = state.api.readiness().await;
            let status = if readiness.ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let mut resp = json(&readiness)?;
            *resp.status_mut() = status;
            Ok(resp)
        }
        RouteId::Events => {
            let close = req.extensions().get::<ConnectionClose>().cloned();
            let api = state.api.clone();
            let body = events::start(
                &state.events,
                || api.subscribe(),
                || async {
                    serde_json::to_string(&task_list(state.api.as_ref()).await).map_err(|e| {
                        ApiError::internal(format!("failed to encode the snapshot: {e}"))
                    })
                },
                state.shutdown.clone(),
                close,
            )
            .await?;
            build(
                Response::builder()
                    .status(StatusCode::OK)
                    .header(CONTENT_TYPE, "text/event-stream")
                    .header(CACHE_CONTROL, "no-cache"),
                body,
            )
        }
    }
}
