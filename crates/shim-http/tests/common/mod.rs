//! What the HTTP tests share: `serve` spawned on a loopback port and awaited, a raw HTTP/1.1
//! client that sends exact bytes and reads the whole answer (`Connection: close`), with the
//! checks every test makes of an answer.

#![allow(
    dead_code,
    reason = "each test file uses the part of this module it needs"
)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shim_http::{ApiError, ComponentsApi, HttpError, Listeners, ServerConfig, ShimApi, serve};
use shim_task::TaskId;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long an answer may take (a safety bound, never a timing assertion).
pub const ANSWER_BOUND: Duration = Duration::from_secs(20);

#[derive(Debug)]
pub struct Resp {
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
    /// and a newline.
    ///
    /// upstream: runner/internal/common/api/api.go (JSONResponseHandler).
    pub fn assert_error(&self, status: u16, message: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("text/plain; charset=utf-8"),
            "{self:?}"
        );
        assert_eq!(
            self.header("x-content-type-options"),
            Some("nosniff"),
            "{self:?}"
        );
        assert_eq!(self.body, format!("{message}\n"), "{self:?}");
    }

    /// Asserts upstream's answer of a handler that returns nothing (shutdown, remove,
    /// install): 200 and a lone newline as `text/plain`.
    pub fn assert_empty_ok(&self) {
        self.assert_error(200, "");
    }
}

/// `serve` running in a task of its own.
pub struct Serving {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub handle: JoinHandle<Result<(), HttpError>>,
}

/// Spawns `serve` on a fresh loopback port (and on `unix`, if given).
pub async fn spawn_serve(
    unix: Option<&Path>,
    api: Arc<dyn ShimApi>,
    components: Arc<dyn ComponentsApi>,
    config: ServerConfig,
) -> Serving {
    let listeners = Listeners::bind("127.0.0.1:0".parse().unwrap(), unix)
        .await
        .unwrap();
    let addr = listeners.tcp_addr();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(serve(listeners, api, components, config, shutdown.clone()));
    Serving {
        addr,
        shutdown,
        handle,
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
    tokio::time::timeout(
        ANSWER_BOUND,
        exchange(s, &request_bytes(method, path, headers, body)),
    )
    .await
    .expect("response within the bound")
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    raw(addr, "GET", path, &[], None).await
}

pub async fn post(addr: SocketAddr, path: &str, body: &str) -> Resp {
    raw(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        Some(body.as_bytes()),
    )
    .await
}
