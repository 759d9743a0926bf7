//! The crate's error type: every foreign error is translated into it once, at the edge. Its
//! `Display` describes its own level only; the foreign error is its `source()` (print the
//! whole with [`shim_util::error_chain`]).

use std::path::PathBuf;
use std::time::Duration;

/// A boxed foreign error kept as the source of a [`RuntimeError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong talking to the container runtime.
///
/// Every variant names what it concerns (`what` is e.g. `container abc123` or
/// `image repo/x:1`), and `op` the operation (`create`, `start`, …).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The container or image does not exist.
    #[error("{what} not found")]
    NotFound {
        /// What was not found, e.g. `container abc`.
        what: String,
    },
    /// The request conflicts with the current state (e.g. a container name in use).
    #[error("{op} {what}: conflict: {message}")]
    Conflict {
        /// The operation.
        op: &'static str,
        /// What it concerns.
        what: String,
        /// The daemon's message.
        message: String,
    },
    /// The daemon cannot be reached (socket missing, connection refused or reset).
    #[error("{op} {what}: container runtime unavailable")]
    DaemonUnavailable {
        /// The operation.
        op: &'static str,
        /// What it concerns.
        what: String,
        /// The transport error.
        #[source]
        source: BoxError,
    },
    /// The daemon answered with an error (its own message is kept verbatim).
    #[error("{op} {what}: {message}")]
    Daemon {
        /// The operation.
        op: &'static str,
        /// What it concerns.
        what: String,
        /// The HTTP status the daemon answered with.
        status: u16,
        /// The daemon's message.
        message: String,
    },
    /// A bind mount's source is missing on the host, so the container was not created. The
    /// shim checks this itself before asking the engine, because engines differ: Docker
    /// refuses such a create, Podman makes an empty directory at the path (a missing runner
    /// binary would become a directory there).
    #[error("create {what}: bind source path does not exist: {}", path.display())]
    BindSourceMissing {
        /// The container concerned, e.g. `container abc`.
        what: String,
        /// The missing source.
        path: PathBuf,
        /// What the lookup said.
        #[source]
        source: std::io::Error,
    },
    /// The engine would silently ignore the container's device requests (Podman's Docker API
    /// ignores NVIDIA ones), so the container was not created: a task must not run without
    /// the GPUs it was given. The shim checks this itself, before asking the engine.
    #[error(
        "create {what}: {engine} ignores {driver:?} device requests through its Docker API: GPU tasks need Docker (CDI on Podman is not supported yet)"
    )]
    DeviceRequestsIgnored {
        /// The container concerned, e.g. `container abc`.
        what: String,
        /// The engine and its version, e.g. `Podman 5.4.2`.
        engine: String,
        /// The driver of the request it would ignore (`nvidia`).
        driver: String,
    },
    /// An image pull failed.
    #[error("pulling image {image} failed after {downloaded_bytes} bytes: {message}")]
    PullFailed {
        /// The image reference.
        image: String,
        /// The daemon's own message.
        message: String,
        /// Bytes downloaded before the failure.
        downloaded_bytes: u64,
    },
    /// An image pull did not finish in time.
    #[error(
        "pulling image {image} timed out after {timeout:?} ({downloaded_bytes} bytes downloaded)"
    )]
    PullTimeout {
        /// The image reference.
        image: String,
        /// The timeout that expired.
        timeout: Duration,
        /// Bytes downloaded before the timeout.
        downloaded_bytes: u64,
    },
    /// The operation was cancelled by the caller.
    #[error("{op} {what}: cancelled")]
    Cancelled {
        /// The operation.
        op: &'static str,
        /// What it concerns.
        what: String,
    },
    /// The pull log could not be written.
    #[error("writing pull log {path}")]
    PullLog {
        /// The log file.
        path: PathBuf,
        /// The io error.
        #[source]
        source: std::io::Error,
    },
    /// Anything else (malformed answer, unexpected transport error).
    #[error("{op} {what}")]
    Other {
        /// The operation.
        op: &'static str,
        /// What it concerns.
        what: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
}

impl RuntimeError {
    /// Whether the daemon could not be reached (the caller should retry later and change
    /// nothing).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::DaemonUnavailable { .. })
    }

    /// Whether the container or image does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// The daemon's own message where there is one (failed start, failed pull…), else the
    /// error's display text with its sources.
    pub fn message(&self) -> String {
        match self {
            Self::Daemon { message, .. }
            | Self::Conflict { message, .. }
            | Self::PullFailed { message, .. } => message.clone(),
            other => shim_util::error_chain(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use shim_util::testing::assert_each_cause_once;

    use super::*;

    /// Every variant with a cause, as a standard reporter prints it: each cause once.
    #[test]
    fn a_reporter_prints_each_cause_once() {
        let io = || std::io::Error::from_raw_os_error(111);
        for e in [
            RuntimeError::DaemonUnavailable {
                op: "create",
                what: "container c1".into(),
                source: Box::new(io()),
            },
            RuntimeError::PullLog {
                path: "/x/pull.log".into(),
                source: io(),
            },
            RuntimeError::BindSourceMissing {
                what: "container c1".into(),
                path: "/x/dstack-runner".into(),
                source: std::io::Error::from_raw_os_error(2),
            },
            RuntimeError::Other {
                op: "inspect",
                what: "container c1".into(),
                source: Box::new(io()),
            },
        ] {
            let chain = assert_each_cause_once(&e);
            assert_eq!(e.message(), chain);
        }
    }
}
