//! Request handling: route, parse, call the engine, answer.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use http::{Request, Response, StatusCode};
use hyper::body::Body;
use serde::Serialize;
use shim_task::{TaskConfig, TaskId, TerminationReason};
use tokio_util::sync::CancellationToken;

use crate::api::{
    ApiError, ComponentInfo, ComponentName, ComponentsApi, InstallRequest, ShimApi,
    ShutdownRequest, TerminateRequest,
};
use crate::body::{ResponseBody, read_json};
use crate::events::{self, ConnectionClose, EventsHub};
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
            tracing::debug!(%method, %path, status = resp.status().as_u16(), "request");
            resp
        }
        Err(err) => {
            let status = err.status();
            if status.is_server_error() {
                tracing::error!(%method, %path, status = status.as_u16(), error = %err,
                    source = ?err.source, "request failed");
            } else {
                tracing::debug!(%method, %path, status = status.as_u16(), error = %err, "request refused");
            }
            error_response(&err)
        }
    }
}

/// The response for an error: its status, its message as `text/plain`, and `Allow` for 405.
pub(crate) fn error_response(err: &ApiError) -> Response<ResponseBody> {
    let mut builder = Response::builder()
        .status(err.status())
        .header(CONTENT_TYPE, "text/plain; charset=utf-8");
    if let Some(allowed) = err
        .source
        .as_deref()
        .and_then(|s| s.downcast_ref::<MethodNotAllowed>())
    {
        builder = builder.header(ALLOW, allowed.allowed.join(", "));
    }
    builder
        .body(ResponseBody::new(err.message.clone()))
        .unwrap_or_else(|_| fallback())
}

fn fallback() -> Response<ResponseBody> {
    let mut resp = Response::new(ResponseBody::new("failed to build the response"));
    *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    resp
}

fn json<T: Serialize>(value: &T) -> Result<Response<ResponseBody>, ApiError> {
    let body = serde_json::to_vec(value)
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

fn empty_ok() -> Result<Response<ResponseBody>, ApiError> {
    json(&serde_json::json!({}))
}

fn task_id(raw: Option<&str>) -> Result<TaskId, ApiError> {
    TaskId::new(raw.unwrap_or_default()).map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn dispatch<B>(state: &State, req: Request<B>) -> Result<Response<ResponseBody>, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let path = req.uri().path().to_owned();
    let resolved = routes::resolve(req.method().as_str(), &path)?;
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
            let body = ResponseBody::new(&b"{}"[..]).on_done(move || {
                if let Some(hook) = hook {
                    return hook(request);
                }
                if request.force {
                    force.cancel();
                }
                shutdown.cancel();
            });
            Response::builder()
                .status(StatusCode::OK)
                .header(CONTENT_TYPE, "application/json")
                .body(body)
                .map_err(|e| ApiError::internal(format!("failed to build the response: {e}")))
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
            let name = ComponentName::parse(&body.name).ok_or_else(|| {
                ApiError::bad_request(format!("unknown component: {}", body.name))
            })?;
            if body.url.is_empty() {
                return Err(ApiError::bad_request("empty url"));
            }
            state.components.install(name, body.url).await?;
            empty_ok()
        }
        RouteId::TaskList => json(&task_list(state.api.as_ref()).await),
        RouteId::TaskSubmit => {
            let config: TaskConfig = read_json(req).await?;
            config
                .validate()
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            json(&state.api.submit(config).await?)
        }
        RouteId::TaskInfo => {
            let id = task_id(resolved.id)?;
            json(&state.api.task_info(&id).await?)
        }
        RouteId::TaskTerminate => {
            let id = task_id(resolved.id)?;
            let body: TerminateRequest = read_json(req).await?;
            let reason = TerminationReason::parse(&body.termination_reason);
            json(
                &state
                    .api
                    .terminate(&id, reason, body.termination_message, body.timeout)
                    .await?,
            )
        }
        RouteId::TaskRemove => {
            let id = task_id(resolved.id)?;
            state.api.remove(&id).await?;
            empty_ok()
        }
        RouteId::TaskMetrics => {
            let id = task_id(resolved.id)?;
            let text = state.api.task_metrics(&id).await?;
            build(
                Response::builder()
                    .status(StatusCode::OK)
                    .header(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8"),
                ResponseBody::new(text),
            )
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
