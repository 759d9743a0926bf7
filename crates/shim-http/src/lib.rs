//! The HTTP API of the dstack shim, wire-compatible with the dstack server's shim client
//! (API "v2", dstack 0.22.x).
//!
//! A hyper 1 server that routes requests ([`routes::ROUTES`]), enforces the body rules
//! (JSON only, at most [`MAX_BODY_BYTES`]), and calls the engine through the [`ShimApi`]
//! trait and the component installer through [`ComponentsApi`]. It knows nothing of Docker or
//! files; the only place where an error becomes a status code is [`ErrorKind::status`].
//!
//! Connections are bounded ([`ConnectionLimits`]: request head read timeout, idle timeout,
//! a cap on connections that evicts the longest-idle one, a cap on the request head's size),
//! so stalled or idle clients cannot make the API unreachable. A request counts as in progress
//! until its answer has been written, so a streaming answer is never idle.
//!
//! Beyond dstack's API, three routes for operators: `GET /api/events` (task changes as
//! Server-Sent Events from [`ShimApi::subscribe`]: a snapshot, then each change; bounded per
//! client and in number, see [`EventsConfig`]), `GET /metrics` ([`ShimApi::metrics`],
//! OpenMetrics text) and `GET /api/ready` ([`ShimApi::readiness`]: 200 or 503). The trait
//! gives these defaults (404, 404, ready), so an implementation needs only dstack's routes.
//!
//! ```no_run
//! # async fn f(api: std::sync::Arc<dyn shim_http::ShimApi>,
//! #            comps: std::sync::Arc<dyn shim_http::ComponentsApi>) -> Result<(), shim_http::HttpError> {
//! use shim_http::{Listeners, ServerConfig, serve};
//! let listeners = Listeners::bind("127.0.0.1:10998".parse().unwrap(), None).await?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! serve(listeners, api, comps, ServerConfig::new("0.22.5+rust.0.1.0"), shutdown).await
//! # }
//! ```

pub mod api;
pub mod body;
#[cfg(feature = "components")]
mod components_api;
#[cfg(feature = "engine")]
mod engine_api;
mod events;
mod gojson;
mod handlers;
pub mod routes;
mod server;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use api::{
    ApiError, ChangeEvent, ChangeFeed, ComponentsApi, ErrorKind, FeedError, InstallRequest,
    InstanceInfo, NoComponents, Readiness, ShimApi, ShutdownRequest, TerminateRequest,
};
pub use body::MAX_BODY_BYTES;
#[cfg(feature = "components")]
pub use components_api::ComponentsHttp;
#[cfg(feature = "engine")]
pub use engine_api::{EngineApi, EngineShutdown};
pub use events::EventsConfig;
pub use server::{
    ConnectionLimits, DrainFuture, Listeners, REQUEST_DRAIN_TIMEOUT, ServerConfig, ShutdownHook,
    serve,
};

/// The oldest healthcheck version with which the dstack server treats running tasks as
/// restart-safe; the version the server is configured with must be a release at least this.
pub const MIN_COMPATIBLE_VERSION: &str = "0.21.3";

/// Errors of setting up or running the server (request errors are [`ApiError`]s).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The API must only be reachable from the host itself.
    #[error("refusing to listen on {addr}: the shim API is loopback-only")]
    NotLoopback {
        /// The rejected address.
        addr: SocketAddr,
    },
    /// The TCP port could not be bound.
    #[error("cannot listen on {addr}")]
    BindTcp {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A listening socket handed over by the parent process (systemd socket activation, an
    /// upgrade in place) cannot be served.
    #[error("cannot serve the inherited socket: {why}")]
    Inherited {
        /// What is wrong with it.
        why: String,
        /// Why, when a system call failed.
        #[source]
        source: Option<std::io::Error>,
    },
    /// Another process accepts on the Unix socket path.
    #[error("unix socket {} is in use by another process", path.display())]
    SocketInUse {
        /// The socket path.
        path: PathBuf,
    },
    /// Something other than a socket exists at the Unix socket path.
    #[error("{} exists and is not a socket; refusing to replace it", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Setting up the Unix socket failed.
    #[error("cannot {op} unix socket {}", path.display())]
    UnixSocket {
        /// The socket path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Whether `version` is a final release (`X.Y[.Z]`, no pre-release or dev suffix, a PEP 440
/// local part `+…` ignored) at least `min` — the way the dstack server reads the healthcheck
/// version.
pub fn is_release_at_least(version: &str, min: &str) -> bool {
    let version = version
        .split_once('+')
        .map_or(version, |(release, _)| release);
    fn parse(v: &str) -> Option<(u64, u64, u64)> {
        let mut it = v.split('.');
        let major = it.next()?.parse().ok()?;
        let minor = it.next()?.parse().ok()?;
        let patch = it.next().map_or(Some(0), |p| p.parse().ok())?;
        if it.next().is_some() {
            return None;
        }
        Some((major, minor, patch))
    }
    matches!((parse(version), parse(min)), (Some(v), Some(m)) if v >= m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_versions() {
        assert!(is_release_at_least("0.21.3", MIN_COMPATIBLE_VERSION));
        assert!(is_release_at_least("0.22.0", MIN_COMPATIBLE_VERSION));
        assert!(is_release_at_least("1.0", MIN_COMPATIBLE_VERSION));
        assert!(!is_release_at_least("0.21.2", MIN_COMPATIBLE_VERSION));
        assert!(!is_release_at_least("0.22.0rc1", MIN_COMPATIBLE_VERSION));
        assert!(!is_release_at_least("1234", MIN_COMPATIBLE_VERSION));
        assert!(!is_release_at_least("", MIN_COMPATIBLE_VERSION));
        assert!(is_release_at_least(
            "0.22.5+rust.0.1.0",
            MIN_COMPATIBLE_VERSION
        ));
    }

    /// Every error with a cause, as a standard reporter prints it: each cause once. An
    /// [`ApiError`] reports none: its message is the answer, its cause is logged beside it.
    #[test]
    fn a_reporter_prints_each_cause_once() {
        use shim_util::testing::assert_each_cause_once;
        let io = || std::io::Error::from_raw_os_error(98);
        let addr = SocketAddr::from(([127, 0, 0, 1], 10998));
        for e in [
            HttpError::BindTcp { addr, source: io() },
            HttpError::Inherited {
                why: "it has no TCP address".into(),
                source: Some(io()),
            },
            HttpError::UnixSocket {
                path: "/run/shim.sock".into(),
                op: "bind",
                source: io(),
            },
        ] {
            assert_each_cause_once(&e);
        }
        let e = ApiError::internal("cannot write x: disk full").with_source(io());
        assert!(std::error::Error::source(&e).is_none());
        assert_eq!(shim_util::error_chain(&e), "cannot write x: disk full");
    }
}

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
