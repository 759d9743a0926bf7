//! Listening sockets and the server loop.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::HttpError;
use crate::api::{ComponentsApi, ShimApi, ShutdownRequest};
use crate::body::BodyReadTimeout;
use crate::events::{ConnectionClose, EventsConfig, EventsHub};
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
    pub async fn bind(tcp: SocketAddr, unix: Option<&Path>) -> Result<Self, HttpError> {
        if !tcp.ip().is_loopback() {
            return Err(HttpError::NotLoopback { addr: tcp });
        }
        let listener = TcpListener::bind(tcp)
            .await
            .map_err(|source| HttpError::BindTcp { addr: tcp, source })?;
        let tcp_addr = listener
            .local_addr()
            .map_err(|source| HttpError::BindTcp { addr: tcp, source })?;
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

    /// Serves `tcp`, a listening socket this process did not bind itself (handed over by
    /// systemd socket activation or by the process it replaced in an upgrade in place) and,
    /// if given, binds a Unix socket at `unix` as [`Listeners::bind`] does.
    ///
    /// The socket must be bound to a loopback address ([`HttpError::NotLoopback`] otherwise): the
    /// API is loopback-only whoever made the socket. It is set non-blocking.
    pub fn from_tcp(tcp: std::net::TcpListener, unix: Option<&Path>) -> Result<Self, HttpError> {
        let inherited = |why: &str| {
            let why = why.to_owned();
            move |source: io::Error| HttpError::Inherited {
                why,
                source: Some(source),
            }
        };
        let tcp_addr = tcp
            .local_addr()
            .map_err(inherited("it has no TCP address"))?;
        if !tcp_addr.ip().is_loopback() {
            return Err(HttpError::NotLoopback { addr: tcp_addr });
        }
        tcp.set_nonblocking(true)
            .map_err(inherited("cannot make it non-blocking"))?;
        let tcp = TcpListener::from_std(tcp).map_err(inherited("cannot register it"))?;
        let unix = match unix {
            Some(path) => Some((bind_unix(path)?, path.to_path_buf())),
            None => None,
        };
        Ok(Self {
            tcp,
            tcp_addr,
            unix,
        })
    }

    /// The listening TCP socket, e.g. to keep a duplicate of it open across [`serve`]'s end:
    /// while any descriptor of it stays open the kernel keeps accepting connections into its
    /// backlog, for whoever serves it next (an upgrade in place hands it to the new binary).
    pub fn tcp_fd(&self) -> BorrowedFd<'_> {
        self.tcp.as_fd()
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

fn bind_unix(path: &Path) -> Result<UnixListener, HttpError> {
    let unix_err = |op: &'static str| {
        move |source: io::Error| HttpError::UnixSocket {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    match fs_err::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(HttpError::SocketInUse {
                    path: path.to_path_buf(),
                });
            }
            tracing::info!(path = %path.display(), "replacing a stale unix socket");
        }
        Ok(_) => {
            return Err(HttpError::NotASocket {
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

/// Called with `POST /api/shutdown`'s request once its `200` has been handed to the
/// connection, instead of cancelling the server's shutdown tokens: the owner decides what a
/// shutdown means (e.g. an upgrade in place, or nothing at all when a new binary is refused)
/// and cancels the tokens it passed to [`serve`] itself.
pub type ShutdownHook = Arc<dyn Fn(ShutdownRequest) + Send + Sync>;

/// Limits that keep the API reachable whatever clients do (stalled connections, idle
/// keep-alive connections, oversized headers). See [`ConnectionLimits::default`] for the
/// defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request head (request line and headers) must be complete within this time of the
    /// server starting to wait for it: when the connection opens, and again after each answer.
    /// A client that trickles its headers is cut off. The connection is closed without an
    /// answer. Taken as a day at most.
    pub header_read_timeout: Duration,
    /// A connection with no request in progress on which nothing has been received or sent for
    /// this long is closed: before its first request and between keep-alive requests.
    pub idle_timeout: Duration,
    /// A request's body must be whole within this time of its head: one that stalls is
    /// answered `408 Request Timeout` and its connection closed, so it holds neither a
    /// connection (a request in progress is never idle, nor evicted) nor a graceful shutdown.
    pub body_read_timeout: Duration,
    /// At most this many connections (TCP and Unix socket together) are served at once. A
    /// connection beyond it makes the server close the connection that has been idle longest
    /// (no request in progress), so stalled connections cannot lock a well-behaved client
    /// out; only if every connection has a request in progress is the new one closed at once.
    pub max_connections: usize,
    /// Largest request head (request line and headers) in bytes; a larger one is answered
    /// `431 Request Header Fields Too Large` and the connection is closed.
    pub max_header_bytes: usize,
}

impl Default for ConnectionLimits {
    /// 30 s to send a request head, 15 s of silence, 30 s to send a body, 512 connections,
    /// 16 KiB of headers.
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(15),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_header_bytes: 16 * 1024,
        }
    }
}

/// The default of [`ServerConfig::request_drain_timeout`].
pub const REQUEST_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Server settings.
#[non_exhaustive]
pub struct ServerConfig {
    /// The healthcheck `version`. The dstack server gates features on it: it must parse as a
    /// release `>= 0.21.3` (see [`crate::MIN_COMPATIBLE_VERSION`]).
    pub version: String,
    /// Cancelled to close every connection at once (also cancelled by
    /// `POST /api/shutdown {"force":true}`).
    pub force_shutdown: CancellationToken,
    /// Awaited during a graceful shutdown once requests have drained.
    pub drain: Option<DrainFuture>,
    /// How long a graceful shutdown lets requests in flight finish (a terminate waits for its
    /// container's stop, which may take the task's whole grace period); the connections still
    /// busy then are closed, and the shutdown goes on with [`ServerConfig::drain`]. Upstream
    /// gives 5 s (`runner/cmd/shim/main.go`: `Shutdown` with a 5 s context).
    pub request_drain_timeout: Duration,
    /// Timeouts and caps of connections.
    pub limits: ConnectionLimits,
    /// Limits of `GET /api/events`.
    pub events: EventsConfig,
    /// What `POST /api/shutdown` does; `None`: cancel the shutdown token (and the forced one
    /// for `{"force":true}`).
    pub on_shutdown: Option<ShutdownHook>,
}

impl ServerConfig {
    /// Settings answering `version` in the healthcheck, with no drain hook.
    pub fn new(version: impl Into<String>) -> Self {
        Self {
            version: version.into(),
            force_shutdown: CancellationToken::new(),
            drain: None,
            request_drain_timeout: REQUEST_DRAIN_TIMEOUT,
            limits: ConnectionLimits::default(),
            events: EventsConfig::default(),
            on_shutdown: None,
        }
    }

    /// Hands `POST /api/shutdown` to `hook` (see [`ShutdownHook`]).
    #[must_use]
    pub fn with_shutdown_hook(mut self, hook: ShutdownHook) -> Self {
        self.on_shutdown = Some(hook);
        self
    }

    /// Sets the limits of `GET /api/events`.
    #[must_use]
    pub fn with_events(mut self, events: EventsConfig) -> Self {
        self.events = events;
        self
    }

    /// Sets the connection limits.
    #[must_use]
    pub fn with_limits(mut self, limits: ConnectionLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets the future awaited during a graceful shutdown.
    #[must_use]
    pub fn with_drain(mut self, drain: impl Future<Output = ()> + Send + 'static) -> Self {
        self.drain = Some(Box::pin(drain));
        self
    }

    /// Sets how long a graceful shutdown lets requests in flight finish.
    #[must_use]
    pub fn with_request_drain_timeout(mut self, timeout: Duration) -> Self {
        self.request_drain_timeout = timeout;
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
            .field("request_drain_timeout", &self.request_drain_timeout)
            .field("limits", &self.limits)
            .field("events", &self.events)
            .field("on_shutdown", &self.on_shutdown.is_some())
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
/// keep-alive connections are closed; those still busy after
/// [`ServerConfig::request_drain_timeout`] are closed), then awaits [`ServerConfig::drain`],
/// and returns. When
/// [`ServerConfig::force_shutdown`] is cancelled (also by `{"force":true}`), it closes every
/// connection at once and returns without draining. Containers are never touched here.
///
/// Connections are bounded by [`ServerConfig::limits`] ([`ConnectionLimits`]).
pub async fn serve(
    listeners: Listeners,
    api: Arc<dyn ShimApi>,
    components: Arc<dyn ComponentsApi>,
    config: ServerConfig,
    shutdown: CancellationToken,
) -> Result<(), HttpError> {
    let ServerConfig {
        version,
        force_shutdown: force,
        drain,
        request_drain_timeout,
        limits,
        events,
        on_shutdown,
    } = config;
    let state = Arc::new(State {
        api,
        components,
        version,
        shutdown: shutdown.clone(),
        force: force.clone(),
        on_shutdown,
        events: EventsHub::new(events),
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
    tracing::info!(addr = %tcp_addr, unix = ?unix_path, ?limits, "serving the shim API");

    let mut conns = Connections {
        set: JoinSet::new(),
        live: HashMap::new(),
        epoch: Instant::now(),
        limits,
        state,
        shutdown: shutdown.clone(),
        force: force.clone(),
    };
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            () = force.cancelled() => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, _peer)) => {
                    // Answers and events go out as written, not held back for an ACK (Nagle).
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                    }
                    conns.serve(stream);
                }
                Err(e) => accept_failed(&e).await,
            },
            accepted = accept_unix(unix.as_ref()) => match accepted {
                Ok(stream) => conns.serve(stream),
                Err(e) => accept_failed(&e).await,
            },
            Some(joined) = conns.set.join_next_with_id(), if !conns.set.is_empty() => {
                conns.ended(joined);
            }
        }
    }
    let mut conns = conns.set;
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
    let deadline = tokio::time::sleep(request_drain_timeout);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            () = force.cancelled() => {
                tracing::info!("forced shutdown during drain: closing every connection");
                conns.shutdown().await;
                return Ok(());
            }
            joined = conns.join_next() => if joined.is_none() { break },
            () = &mut deadline => {
                tracing::warn!(in_flight = conns.len(), timeout = ?request_drain_timeout,
                    "graceful shutdown: requests still in flight after the drain timeout; closing their connections");
                conns.shutdown().await;
                break;
            }
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

/// The connections being served, and what a new one needs.
struct Connections {
    set: JoinSet<()>,
    /// The live connections by task, for the cap.
    live: HashMap<tokio::task::Id, Arc<Activity>>,
    epoch: Instant,
    limits: ConnectionLimits,
    state: Arc<State>,
    shutdown: CancellationToken,
    force: CancellationToken,
}

impl Connections {
    /// Serves `io` in a task of its own, after making room under the cap.
    fn serve<I>(&mut self, io: I)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        if self.live.len() >= self.limits.max_connections && !self.evict_longest_idle() {
            tracing::warn!(
                max_connections = self.limits.max_connections,
                "every connection has a request in progress: closing a new connection at once"
            );
            return;
        }
        let activity = Arc::new(Activity::new(self.epoch));
        let handle = self.set.spawn(connection(
            io,
            activity.clone(),
            self.state.clone(),
            self.limits,
            self.shutdown.clone(),
            self.force.clone(),
        ));
        self.live.insert(handle.id(), activity);
    }

    /// Closes the live connection that has been idle longest (no request in progress);
    /// false if there is none.
    fn evict_longest_idle(&mut self) -> bool {
        let victim = self
            .live
            .values()
            .filter(|a| a.in_flight.load(Ordering::Acquire) == 0 && !a.close.is_cancelled())
            .min_by_key(|a| a.last_ms.load(Ordering::Relaxed));
        match victim {
            Some(activity) => {
                tracing::debug!(
                    max_connections = self.limits.max_connections,
                    "connection limit reached: closing the longest-idle connection"
                );
                activity.close.cancel();
                true
            }
            None => false,
        }
    }

    /// A connection task ended.
    fn ended(&mut self, joined: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let id = match joined {
            Ok((id, ())) => id,
            Err(e) => {
                tracing::warn!(error = %e, "a connection task failed");
                e.id()
            }
        };
        self.live.remove(&id);
    }
}

/// What the cap and the idle timeout need to know of one connection.
#[derive(Debug)]
struct Activity {
    epoch: Instant,
    /// When a byte was last received or sent, or a request ended (ms since `epoch`).
    last_ms: AtomicU64,
    /// Requests being handled or answered (0 or 1 with HTTP/1.1 without pipelining): from
    /// the request head until the response body has been written (or dropped), so a
    /// streaming answer (`GET /api/events`) is never idle.
    in_flight: AtomicUsize,
    /// Cancelled to close the connection (evicted under the cap).
    close: CancellationToken,
    /// A byte was ever received: a connection without one is fresh (its client's first
    /// request may be on its way: through an SSH tunnel, one round trip after the accept).
    received: AtomicBool,
}

impl Activity {
    fn new(epoch: Instant) -> Self {
        let activity = Self {
            epoch,
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            close: CancellationToken::new(),
            received: AtomicBool::new(false),
        };
        activity.touch();
        activity
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long nothing has happened on the connection.
    fn idle_for(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed)),
        )
    }
}

/// Counts a request as in progress while it lives: it is moved into the response body, so
/// the request counts until its answer has been written.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An IO stream that records on its [`Activity`] every read or write that moved bytes.
struct Tracked<I> {
    io: I,
    activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Tracked<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.touch();
            this.activity.received.store(true, Ordering::Release);
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Tracked<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Serves one connection until it ends, is idle for too long, is evicted, or the server
/// shuts down (gracefully: the request in progress finishes; forced: closed at once).
/// How long a graceful shutdown leaves a connection that has received nothing yet for its
/// first byte (see [`connection`]).
const FRESH_CONNECTION_GRACE: Duration = Duration::from_secs(5);
/// How often such a connection is looked at meanwhile.
const FRESH_CONNECTION_POLL: Duration = Duration::from_millis(20);

async fn connection<I>(
    io: I,
    activity: Arc<Activity>,
    state: Arc<State>,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    force: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = {
        let activity = activity.clone();
        service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let state = state.clone();
            let in_flight = InFlight::new(activity.clone());
            req.extensions_mut()
                .insert(ConnectionClose(activity.close.clone()));
            req.extensions_mut()
                .insert(BodyReadTimeout(limits.body_read_timeout));
            async move {
                let mut response = handle(state, req).await;
                response.body_mut().hold(in_flight);
                Ok::<_, std::convert::Infallible>(response)
            }
        })
    };
    let io = Tracked {
        io,
        activity: activity.clone(),
    };
    let conn = http1::Builder::new()
        // Header names as Go writes them (`Content-Type`), not lowercase.
        .title_case_headers(true)
        .timer(TokioTimer::new())
        // hyper adds it to an `Instant`, which panics past the clock's range.
        .header_read_timeout(limits.header_read_timeout.min(Duration::from_secs(86_400)))
        .max_header_size(limits.max_header_bytes)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut draining = false;
    // A graceful shutdown came while the connection was fresh (nothing received yet): hyper
    // would close it at once, and the request its client is sending would find it closed.
    // It gets FRESH_CONNECTION_GRACE for its first byte, as Go's server gives a new
    // connection 5 s before it counts as idle.
    let mut fresh_until: Option<tokio::time::Instant> = None;
    loop {
        if let Some(until) = fresh_until
            && (activity.received.load(Ordering::Acquire) || tokio::time::Instant::now() >= until)
        {
            conn.as_mut().graceful_shutdown();
            fresh_until = None;
        }
        // While a request is in progress the connection is not idle: look again later.
        let idle_left = if activity.in_flight.load(Ordering::Acquire) > 0 {
            limits.idle_timeout
        } else {
            limits.idle_timeout.saturating_sub(activity.idle_for())
        };
        tokio::select! {
            biased;
            () = force.cancelled() => return,
            () = activity.close.cancelled() => return,
            res = conn.as_mut() => {
                log_conn_end(res);
                return;
            }
            () = shutdown.cancelled(), if !draining => {
                draining = true;
                if activity.received.load(Ordering::Acquire) {
                    conn.as_mut().graceful_shutdown();
                } else {
                    fresh_until = Some(tokio::time::Instant::now() + FRESH_CONNECTION_GRACE);
                }
            }
            () = tokio::time::sleep(FRESH_CONNECTION_POLL), if fresh_until.is_some() => {}
            () = tokio::time::sleep(idle_left) => {
                let idle = activity.in_flight.load(Ordering::Acquire) == 0
                    && activity.idle_for() >= limits.idle_timeout;
                if idle {
                    tracing::debug!(idle_timeout = ?limits.idle_timeout, "closing an idle connection");
                    return;
                }
            }
        }
    }
}

fn log_conn_end(res: Result<(), hyper::Error>) {
    if let Err(e) = res {
        tracing::debug!(error = %shim_util::error_chain(&e), "connection ended with an error");
    }
}
