//! The Docker client's transport over a Unix socket: one hyper client whose connections are
//! kept alive and reused (a pool), instead of bollard's own `connect_with_unix`, which opens a
//! new connection for every request (`pool_max_idle_per_host(0)`).
//!
//! A request on a pooled connection saves the `connect(2)`/`accept(2)` pair, the daemon's
//! per-connection setup and, on the shim's side, a new hyper connection task. A connection
//! the daemon closed is noticed by hyper and dropped from the pool; a request that was not
//! yet sent on it is retried on another one (hyper's `retry_canceled_requests`).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bollard::{API_DEFAULT_VERSION, BollardRequest, Docker};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// How many idle connections the pool keeps (the engine's requests come in bursts of a few
/// dozen at most: tasks started or stopped at once).
pub const POOL_MAX_IDLE: usize = 32;
/// How long an idle connection is kept before it is closed.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Connects to the daemon's socket at `path` for every new connection of the pool (the
/// request's URI names no host: bollard's custom transport puts a placeholder there).
#[derive(Debug, Clone)]
struct SocketConnector {
    path: Arc<PathBuf>,
}

impl tower_service::Service<http::Uri> for SocketConnector {
    type Response = TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let path = self.path.clone();
        Box::pin(async move {
            let stream = tokio::net::UnixStream::connect(path.as_path()).await?;
            Ok(TokioIo::new(stream))
        })
    }
}

/// A bollard client of the daemon at the Unix socket `path` whose connections are pooled
/// (at most `max_idle` idle ones, each closed after `idle_timeout`; `max_idle` 0 opens a new
/// connection per request, as bollard's own). Requests time out after `timeout` (bollard's
/// own bound; the runtime sets its own after).
pub fn pooled_unix(
    path: &Path,
    max_idle: usize,
    idle_timeout: Duration,
    timeout: Duration,
) -> Result<Docker, bollard::errors::Error> {
    if !path.exists() {
        return Err(bollard::errors::Error::SocketNotFoundError(
            path.display().to_string(),
        ));
    }
    let connector = SocketConnector {
        path: Arc::new(path.to_owned()),
    };
    let client = Arc::new(
        Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(max_idle)
            .pool_idle_timeout(idle_timeout)
            .build(connector),
    );
    Docker::connect_with_custom_transport(
        move |request: BollardRequest| {
            let client = client.clone();
            async move {
                client
                    .request(request)
                    .await
                    .map_err(bollard::errors::Error::from)
            }
        },
        // Any host: the connector ignores it (Docker ignores the Host header).
        Some("http://docker"),
        timeout.as_secs().max(1),
        API_DEFAULT_VERSION,
    )
}

/// The socket path of a `DOCKER_HOST`-style address (`unix:///path`), if it is one.
pub fn unix_socket_of(host: &str) -> Option<PathBuf> {
    host.strip_prefix("unix://").map(PathBuf::from)
}
