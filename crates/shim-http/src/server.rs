//! Listening sockets and the server loop.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::api::{ComponentsApi, ShimApi};
use crate::handlers::{State, handle};

/// The sockets the API listens on: TCP on a loopback address, and optionally a Unix socket.
///
/// Binding is separate from [`serve`] so that the binary can fail fast on a taken port and
/// learn the port (tests bind port 0) before the engine has finished restoring tasks.
#[derive(Debug)]
pub struct Listeners {
    tcp: TcpListener,
    tcp_addr: SocketAddr,
    unix: Option<(UnixListener, PathBuf)>,
}

impl Listeners {
    /// Binds `tcp` (must be a loopback address: the API has no authentication and is reached
    /// through an SSH tunnel) and, if given, a Unix socket at `unix` with mode 0600.
    ///
    /// A stale socket file at `unix` (nobody accepts on it) is replaced; a live one, or a file
    /// that is not a socket, is an error. The socket is bound under a temporary name, chmod-ed,
    /// then renamed into place, so it is never reachable with wider permissions.
    pub async fn bind(tcp: SocketAddr, unix: Option<&Path>) -> Result<Self, Error> {
        if !tcp.ip().is_loopback() {
            return Err(Error::NotLoopback { addr: tcp });
        }
        let listener = TcpListener::bind(tcp)
            .await
            .map_err(|source| Error::BindTcp { addr: tcp, source })?;
        let tcp_addr = listener
            .local_addr()
            .map_err(|source| Error::BindTcp { addr: tcp, source })?;
        let unix = match unix {
            Some(path) => Some((bind_unix(path)?, path.to_path_buf())),
            None => None,
        };
        Ok(Self {
            tcp: listener,
            tcp_addr,
            unix,
        })
    }

    /// The bound TCP address (with the real port when 0 was asked for).
    pub fn tcp_addr(&self) -> SocketAddr {
        self.tcp_addr
    }

    /// The Unix socket path, if any.
    pub fn unix_path(&self) -> Option<&Path> {
        self.unix.as_ref().map(|(_, p)| p.as_path())
    }
}

fn bind_unix(path: &Path) -> Result<UnixListener, Error> {
    let unix_err = |op: &'static str| {
        move |source: io::Error| Error::UnixSocket {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    match fs_err::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(Error::SocketInUse {
                    path: path.to_path_buf(),
                });
            }
            tracing::info!(path = %path.display(), "replacing a stale unix socket");
        }
        Ok(_) => {
            return Err(Error::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(unix_err("inspect")(e)),
    }
    let file_name = path
        .file_name()
        .ok_or_else(|| unix_err("name")(io::Error::other("the path has no file name")))?;
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    match fs_err::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(unix_err("clean up")(e)),
        _ => {}
    }
    let listener = UnixListener::bind(&tmp).map_err(unix_err("bind"))?;
    let placed = fs_err::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| fs_err::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = fs_err::remove_file(&tmp);
        return Err(unix_err("set up")(e));
    }
    Ok(listener)
}

/// A future the server awaits during a graceful shutdown, after the last in-flight request
/// finished: the binary's background jobs (engine start tasks, component installs).
pub type DrainFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Server settings.
pub struct ServerConfig {
    /// The healthcheck `version`. The dstack server gates features on it: it must parse as a
    /// release `>= 0.21.3` (see [`crate::MIN_COMPATIBLE_VERSION`]).
    pub version: String,
    /// Cancelled to close every connection at once (also cancelled by
    /// `POST /api/shutdown {"force":true}`).
    pub force_shutdown: CancellationToken,
    /// Awaited during a graceful shutdown once requests have drained.
    pub drain: Option<DrainFuture>,
}

impl ServerConfig {
    /// Settings answering `version` in the healthcheck, with no drain hook.
    pub fn new(version: impl Into<String>) -> Self {
        Self {
            version: version.into(),
            force_shutdown: CancellationToken::new(),
            drain: None,
        }
    }

    /// Sets the future awaited during a graceful shutdown.
    #[must_use]
    pub fn with_drain(mut self, drain: impl Future<Output = ()> + Send + 'static) -> Self {
        self.drain = Some(Box::pin(drain));
        self
    }

    /// Uses `token` as the forced-shutdown signal (e.g. a second SIGTERM).
    #[must_use]
    pub fn with_force_shutdown(mut self, token: CancellationToken) -> Self {
        self.force_shutdown = token;
        self
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("version", &self.version)
            .field("force_shutdown", &self.force_shutdown.is_cancelled())
            .field("drain", &self.drain.is_some())
            .finish()
    }
}

/// Serves the API until shut down.
///
/// Call it only once the engine's first reconcile cycle has completed, so the first answer
/// about any task already reflects containers that ended while the shim was down.
///
/// Shutdown: when `shutdown` is cancelled (by the caller, e.g. on SIGTERM, or by
/// `POST /api/shutdown`), the server stops accepting, lets in-flight requests finish (idle
/// keep-alive connections are closed), then awaits [`ServerConfig::drain`], and returns. When
/// [`ServerConfig::force_shutdown`] is cancelled (also by `{"force":true}`), it closes every
/// connection at once and returns without draining. Containers are never touched here.
pub async fn serve(
    listeners: Listeners,
    api: Arc<dyn ShimApi>,
    components: Arc<dyn ComponentsApi>,
    config: ServerConfig,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let ServerConfig {
        version,
        force_shutdown: force,
        drain,
    } = config;
    let state = Arc::new(State {
        api,
        components,
        version,
        shutdown: shutdown.clone(),
        force: force.clone(),
    });
    let Listeners {
        tcp,
        tcp_addr,
        unix,
    } = listeners;
    let (unix, unix_path) = match unix {
        Some((l, p)) => (Some(l), Some(p)),
        None => (None, None),
    };
    tracing::info!(addr = %tcp_addr, unix = ?unix_path, "serving the shim API");

    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            () = force.cancelled() => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, _peer)) => {
                    conns.spawn(connection(stream, state.clone(), shutdown.clone(), force.clone()));
                }
                Err(e) => accept_failed(&e).await,
            },
            accepted = accept_unix(unix.as_ref()) => match accepted {
                Ok(stream) => {
                    conns.spawn(connection(stream, state.clone(), shutdown.clone(), force.clone()));
                }
                Err(e) => accept_failed(&e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(tcp);
    drop(unix);
    if let Some(path) = &unix_path
        && let Err(e) = fs_err::remove_file(path)
    {
        tracing::warn!(error = %e, "could not remove the unix socket");
    }

    if force.is_cancelled() {
        tracing::info!("forced shutdown: closing every connection");
        conns.shutdown().await;
        return Ok(());
    }
    tracing::info!(
        in_flight = conns.len(),
        "graceful shutdown: draining connections"
    );
    loop {
        tokio::select! {
            biased;
            () = force.cancelled() => {
                tracing::info!("forced shutdown during drain: closing every connection");
                conns.shutdown().await;
                return Ok(());
            }
            joined = conns.join_next() => if joined.is_none() { break },
        }
    }
    if let Some(drain) = drain {
        tracing::info!("graceful shutdown: waiting for background jobs");
        tokio::select! {
            biased;
            () = force.cancelled() => tracing::info!("forced shutdown during drain"),
            () = drain => {}
        }
    }
    tracing::info!("the API server stopped");
    Ok(())
}

async fn accept_unix(unix: Option<&UnixListener>) -> io::Result<tokio::net::UnixStream> {
    match unix {
        Some(l) => l.accept().await.map(|(s, _)| s),
        None => std::future::pending().await,
    }
}

/// Accept errors (e.g. too many open files) are transient: log, back off briefly, go on.
async fn accept_failed(e: &io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

async fn connection<I>(
    io: I,
    state: Arc<State>,
    shutdown: CancellationToken,
    force: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(state, req).await) }
    });
    let conn = http1::Builder::new().serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        biased;
        () = force.cancelled() => return,
        res = conn.as_mut() => {
            log_conn_end(res);
            return;
        }
        () = shutdown.cancelled() => {}
    }
    conn.as_mut().graceful_shutdown();
    tokio::select! {
        biased;
        () = force.cancelled() => {}
        res = conn.as_mut() => log_conn_end(res),
    }
}

fn log_conn_end(res: Result<(), hyper::Error>) {
    if let Err(e) = res {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}
