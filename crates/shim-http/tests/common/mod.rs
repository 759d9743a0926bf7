//! What the HTTP tests share: a fake engine and installer, `serve` over them on a loopback
//! port, and a raw HTTP/1.1 client (exact bytes, `Connection: close`) with its checks.

#![allow(
    dead_code,
    reason = "each test file uses the part of this module it needs"
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use shim_components::{ComponentInfo, ComponentName, ComponentStatus};
use shim_http::{
    ApiError, ChangeEvent, ChangeFeed, ComponentsApi, FeedError, HttpError, InstanceInfo,
    Listeners, Readiness, ServerConfig, ShimApi, serve,
};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long an answer may take (a safety bound, never a timing assertion).
pub const ANSWER_BOUND: Duration = Duration::from_secs(20);

#[derive(Debug)]
pub struct Resp {
    /// What was asked (and the table row asking it), so that a failed check names it.
    pub request: String,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// The whole answer as received.
    pub raw: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Asserts the status, the content type (`None`: no such header) and the whole body.
    #[track_caller]
    pub fn assert_answer(&self, status: u16, content_type: Option<&str>, body: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("content-type"), content_type, "{self:?}");
        assert_eq!(self.body, body, "{self:?}");
    }

    /// Asserts a JSON answer as Go's encoder writes it (one line) and parses it.
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{self:?}"
        );
        assert!(
            self.body.ends_with('\n') && self.body.matches('\n').count() == 1,
            "one line: {self:?}"
        );
        serde_json::from_str(&self.body).unwrap()
    }

    /// Asserts an error answer as Go's `http.Error` writes it (upstream's handlers answer
    /// every error so): status, `text/plain; charset=utf-8`, `nosniff`, the exact message
    /// and a newline. upstream: runner/internal/common/api/api.go (JSONResponseHandler).
    #[track_caller]
    pub fn assert_error(&self, status: u16, message: &str) {
        let got = (
            self.status,
            self.header("content-type"),
            self.header("x-content-type-options"),
            self.body.as_str(),
        );
        let text = Some("text/plain; charset=utf-8");
        let want = (status, text, Some("nosniff"), &*format!("{message}\n"));
        assert_eq!(got, want, "{self:?}");
    }

    /// Asserts upstream's answer of a handler that returns nothing (shutdown, remove,
    /// install): 200 and a lone newline as `text/plain`.
    #[track_caller]
    pub fn assert_empty_ok(&self) {
        self.assert_error(200, "");
    }

    /// Names the table row that asked, for a failed check to print.
    pub fn row(self, name: &str) -> Resp {
        let request = format!("{name}: {}", self.request);
        Resp { request, ..self }
    }
}

/// What the fake engines answer for a task they do not have.
pub fn unknown_task(id: &TaskId) -> ApiError {
    ApiError::not_found(format!("task {id} not found"))
}

/// Waits (bounded) for `serve`'s task to end, and asserts that `serve` returned `Ok`.
pub async fn serve_returns(handle: JoinHandle<Result<(), HttpError>>) {
    tokio::time::timeout(ANSWER_BOUND, handle)
        .await
        .expect("serve returns")
        .unwrap()
        .unwrap();
}

pub fn parse_response(raw: &[u8]) -> Resp {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("incomplete response: {text:?}"));
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    Resp {
        request: String::new(),
        status,
        headers,
        body: body.to_owned(),
        raw: text.into_owned(),
    }
}

pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, request: &[u8]) -> Resp {
    s.write_all(request).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    parse_response(&raw)
}

pub fn request_bytes(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    if let Some(b) = body {
        bytes.extend_from_slice(b);
    }
    bytes
}

pub async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let s = TcpStream::connect(addr).await.unwrap();
    let request = request_bytes(method, path, headers, body);
    let answer = tokio::time::timeout(ANSWER_BOUND, exchange(s, &request)).await;
    // The body's start names the request well enough.
    let body: String = String::from_utf8_lossy(body.unwrap_or_default())
        .chars()
        .take(200)
        .collect();
    Resp {
        request: format!("{method} {path} {body}"),
        ..answer.expect("response within the bound")
    }
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    raw(addr, "GET", path, &[], None).await
}

pub async fn post(addr: SocketAddr, path: &str, body: &str) -> Resp {
    let json = [("Content-Type", "application/json")];
    raw(addr, "POST", path, &json, Some(body.as_bytes())).await
}

// ---------------------------------------------------------------------------------------------
// The fake engine and installer every test file serves.

type Item = Result<ChangeEvent, FeedError>;

pub struct FakeEngine {
    pub tasks: Mutex<HashMap<TaskId, TaskInfo>>,
    pub terminations: Mutex<Vec<(String, String, String, u64)>>,
    /// `GET /api/tasks/slow` signals `entered` and waits for `release`.
    pub entered: Notify,
    pub release: Notify,
    /// No DCGM exporter: `has_task_metrics` says so.
    pub no_exporter: AtomicBool,
    /// What `GET /api/events` streams (or the feed errors injected).
    pub changes: broadcast::Sender<Item>,
    pub readiness: Mutex<Readiness>,
    /// No change feed and no metrics: answered as the trait's defaults answer.
    pub plain: AtomicBool,
}

impl Default for FakeEngine {
    fn default() -> Self {
        Self {
            tasks: Mutex::default(),
            terminations: Mutex::default(),
            entered: Notify::new(),
            release: Notify::new(),
            no_exporter: AtomicBool::new(false),
            changes: broadcast::channel(16 * 1024).0,
            readiness: Mutex::new(Readiness::ready()),
            plain: AtomicBool::new(false),
        }
    }
}

impl FakeEngine {
    /// Adds a task as it would be in `status`.
    pub fn insert(&self, id: &str, status: TaskStatus) {
        let id = TaskId::new(id).unwrap();
        self.tasks
            .lock()
            .unwrap()
            .insert(id.clone(), info(&id, status));
    }

    /// Sends a change to every subscriber (none is fine: the test then sees what is missing).
    pub fn send(&self, seq: u64, json: impl Into<String>) {
        let json = json.into();
        let _ = self.changes.send(Ok(ChangeEvent { seq, json }));
    }
}

struct Feed(broadcast::Receiver<Item>);

#[async_trait]
impl ChangeFeed for Feed {
    async fn recv(&mut self) -> Result<ChangeEvent, FeedError> {
        match self.0.recv().await {
            Ok(item) => item,
            Err(broadcast::error::RecvError::Lagged(missed)) => Err(FeedError::Lagged { missed }),
            Err(broadcast::error::RecvError::Closed) => Err(FeedError::Closed),
        }
    }
}

pub fn info(id: &TaskId, status: TaskStatus) -> TaskInfo {
    TaskInfo {
        id: id.clone(),
        status,
        termination_reason: String::new(),
        termination_message: String::new(),
        ports: None,
        image_pull_progress: None,
        container_name: format!("{id}-0123abcd"),
        container_id: String::new(),
        gpu_ids: None,
    }
}

#[async_trait]
impl ShimApi for FakeEngine {
    async fn submit(&self, config: TaskConfig) -> Result<TaskInfo, ApiError> {
        let id = &config.id;
        let mut tasks = self.tasks.lock().unwrap();
        if tasks.contains_key(id) {
            return Err(ApiError::conflict(format!("task {id} already exists")));
        }
        let i = info(&config.id, TaskStatus::Pending);
        tasks.insert(config.id.clone(), i.clone());
        Ok(i)
    }

    async fn task_info(&self, id: &TaskId) -> Result<TaskInfo, ApiError> {
        if id.as_str() == "slow" {
            self.entered.notify_one();
            self.release.notified().await;
            return Ok(info(id, TaskStatus::Running));
        }
        if id.as_str() == "boom" {
            return Err(ApiError::internal("engine exploded"));
        }
        let tasks = self.tasks.lock().unwrap();
        tasks.get(id).cloned().ok_or_else(|| unknown_task(id))
    }

    async fn list_tasks(&self) -> Vec<(TaskId, TaskStatus)> {
        let tasks = self.tasks.lock().unwrap();
        let mut v: Vec<_> = tasks.values().map(|t| (t.id.clone(), t.status)).collect();
        v.sort();
        v
    }

    async fn terminate(
        &self,
        id: &TaskId,
        reason: TerminationReason,
        message: String,
        timeout_s: u64,
    ) -> Result<TaskInfo, ApiError> {
        self.terminations.lock().unwrap().push((
            id.to_string(),
            reason.to_string(),
            message.clone(),
            timeout_s,
        ));
        let mut tasks = self.tasks.lock().unwrap();
        let t = tasks.get_mut(id).ok_or_else(|| unknown_task(id))?;
        if t.status != TaskStatus::Terminated {
            t.status = TaskStatus::Terminated;
            t.termination_reason = reason.to_string();
            t.termination_message = message;
        }
        Ok(t.clone())
    }

    async fn remove(&self, id: &TaskId) -> Result<(), ApiError> {
        let mut tasks = self.tasks.lock().unwrap();
        match tasks.get(id) {
            None => Err(unknown_task(id)),
            Some(t) if t.status != TaskStatus::Terminated => {
                Err(ApiError::conflict(format!("task {id} is not terminated")))
            }
            Some(_) => {
                tasks.remove(id);
                Ok(())
            }
        }
    }

    async fn instance_info(&self) -> InstanceInfo {
        InstanceInfo {
            gpu_vendor: Some("nvidia".into()),
            gpu_driver_version: None,
        }
    }

    async fn instance_health(&self) -> serde_json::Value {
        json!({ "dcgm": null })
    }

    async fn task_metrics(&self, id: &TaskId) -> Result<String, ApiError> {
        match id.as_str() {
            "metrics-ok" => Ok("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} 42\n".into()),
            "metrics-empty" => Ok(String::new()),
            "metrics-bad" => Err(ApiError::bad_gateway("exporter: connection refused")),
            _ => Err(unknown_task(id)),
        }
    }

    fn has_task_metrics(&self) -> bool {
        !self.no_exporter.load(Ordering::SeqCst)
    }

    fn subscribe(&self) -> Result<Box<dyn ChangeFeed>, ApiError> {
        if self.plain.load(Ordering::SeqCst) {
            return Err(ApiError::not_found("task change events are not available"));
        }
        Ok(Box::new(Feed(self.changes.subscribe())))
    }

    async fn metrics(&self) -> Result<String, ApiError> {
        if self.plain.load(Ordering::SeqCst) {
            return Err(ApiError::not_found("metrics are not available"));
        }
        Ok("# TYPE x counter\nx_total 1\n# EOF\n".to_owned())
    }

    async fn readiness(&self) -> Readiness {
        self.readiness.lock().unwrap().clone()
    }
}

#[derive(Default)]
pub struct FakeComponents {
    pub installs: Mutex<Vec<(ComponentName, String)>>,
}

#[async_trait]
impl ComponentsApi for FakeComponents {
    async fn list(&self) -> Vec<ComponentInfo> {
        let runner = (ComponentName::Runner, "1.2.3", ComponentStatus::Installed);
        let shim = (ComponentName::Shim, "", ComponentStatus::Installing);
        let info = |(name, version, status): (_, &str, _)| ComponentInfo {
            name,
            version: version.into(),
            status,
        };
        vec![info(runner), info(shim)]
    }

    async fn install(&self, name: ComponentName, url: String) -> Result<(), ApiError> {
        if name == ComponentName::Shim {
            return Err(ApiError::conflict("already installing"));
        }
        self.installs.lock().unwrap().push((name, url));
        Ok(())
    }
}

/// A server under test over fresh fakes: `serve` running in a task of its own.
pub struct Server {
    pub addr: SocketAddr,
    pub engine: Arc<FakeEngine>,
    pub components: Arc<FakeComponents>,
    pub shutdown: CancellationToken,
    pub force: CancellationToken,
    pub handle: JoinHandle<Result<(), HttpError>>,
}

/// Starts a server on a loopback port (and on `unix`, if given) over fresh fakes, with the
/// configuration `configure` makes of the default one.
pub async fn start_server(
    unix: Option<&Path>,
    configure: impl FnOnce(ServerConfig) -> ServerConfig,
) -> Server {
    let engine = Arc::new(FakeEngine::default());
    let components = Arc::new(FakeComponents::default());
    let force = CancellationToken::new();
    let config = configure(ServerConfig::new("0.22.0").with_force_shutdown(force.clone()));
    let listeners = Listeners::bind("127.0.0.1:0".parse().unwrap(), unix)
        .await
        .unwrap();
    let addr = listeners.tcp_addr();
    let shutdown = CancellationToken::new();
    let (api, installer) = (engine.clone(), components.clone());
    let handle = tokio::spawn(serve(listeners, api, installer, config, shutdown.clone()));
    Server {
        addr,
        engine,
        components,
        shutdown,
        force,
        handle,
    }
}

pub async fn stop(server: Server) {
    server.shutdown.cancel();
    serve_returns(server.handle).await;
}

impl Server {
    pub async fn get(&self, path: &str) -> Resp {
        get(self.addr, path).await
    }

    /// A request with a JSON body.
    pub async fn post(&self, path: &str, body: &str) -> Resp {
        post(self.addr, path, body).await
    }

    /// A POST request with `content_type` (`None`: no such header) and `body` (`None`: none).
    pub async fn send(&self, path: &str, content_type: Option<&str>, body: Option<&[u8]>) -> Resp {
        let headers: Vec<_> = content_type
            .map(|c| ("Content-Type", c))
            .into_iter()
            .collect();
        raw(self.addr, "POST", path, &headers, body).await
    }

    /// A request with no body at all (and no Content-Type).
    pub async fn bare(&self, method: &str, path: &str) -> Resp {
        raw(self.addr, method, path, &[], None).await
    }

    /// `request` is `METHOD /path`, then a space and a JSON body if there is one; without
    /// one, no body and no Content-Type are sent.
    pub async fn ask(&self, request: &str) -> Resp {
        let mut parts = request.splitn(3, ' ');
        let (method, path) = (parts.next().unwrap(), parts.next().unwrap());
        match parts.next() {
            Some(body) if method == "POST" => self.post(path, body).await,
            Some(_) => panic!("only a POST has a body here: {request}"),
            None => self.bare(method, path).await,
        }
    }

    /// Asks each row's request in turn and asserts upstream's error answer: the status and
    /// the exact message ([`Resp::assert_error`]). A row reads
    /// `name: METHOD /path [JSON body] => STATUS message` (the request as [`Server::ask`]).
    pub async fn assert_refusals(&self, rows: &[&str]) {
        for row in rows {
            let (name, exchange) = row.split_once(": ").unwrap();
            let (request, answer) = exchange.split_once(" => ").unwrap();
            let (status, message) = answer.split_once(' ').unwrap();
            let r = self.ask(request).await.row(name);
            r.assert_error(status.parse().unwrap(), message);
        }
    }
}
