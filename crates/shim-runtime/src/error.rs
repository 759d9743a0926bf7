//! The crate's error type: every foreign error is translated into it once, at the edge. Its
//! `Display` describes its own level only; the foreign error is its `source()` (print the
//! whole with [`shim_util::error_chain`]).

use std::path::PathBuf;
use std::time::Duration;

use shim_util::BoxError;

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
    /// shim checks this itself, because engines differ: Docker refuses such a create (the
    /// shim then names the path), Podman makes an empty directory at the path (a missing
    /// runner binary would become a directory there), so it is asked only once the sources
    /// are found.
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
        "create {what}: {engine} ignores {driver:?} device requests through its Docker API: GPU tasks need a CDI spec there (Podman 5+; `nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml`) or Docker"
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
    /// An image pull stopped moving: the engine sent nothing about it (no byte counted, no
    /// layer's status, no extraction step) for `stalled_for`, the pull's stall timeout.
    #[error(
        "pulling image {image} stalled: nothing moved for {}; {} of {}{} ({done_bytes} of \
         {total_bytes} bytes) downloaded in {}, average {}/s",
        fmt_duration(*stalled_for),
        fmt_bytes(*done_bytes),
        if *total_known { "" } else { "at least " },
        fmt_bytes(*total_bytes),
        fmt_duration(*elapsed),
        fmt_bytes(*rate),
    )]
    PullStalled {
        /// The image reference.
        image: String,
        /// How long nothing moved (the stall timeout that expired).
        stalled_for: Duration,
        /// Bytes downloaded before the stall.
        done_bytes: u64,
        /// The image's size, summed over the layers the engine had announced.
        total_bytes: u64,
        /// Whether every layer's size was known (else `total_bytes` may grow).
        total_known: bool,
        /// How long the pull ran, the stall included.
        elapsed: Duration,
        /// The average rate over `elapsed`, bytes per second.
        rate: u64,
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

/// A byte count for people: `512 B`, `9.0 MiB`, `11.3 GiB` (powers of 1024).
pub(crate) fn fmt_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    // Precision loss is irrelevant for a rounded figure.
    #[allow(clippy::cast_precision_loss)]
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A duration as Go prints it, to whole seconds below an hour's precision: `5m0s`, `1h2m3s`,
/// `1.5s` under ten seconds.
pub(crate) fn fmt_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs < 10 {
        return format!("{:.1}s", d.as_secs_f64());
    }
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
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

    /// A stall says what happened in numbers: how long nothing moved, how much of how much
    /// came, in how long, at what average rate.
    #[test]
    fn a_stall_says_what_happened_in_numbers() {
        let e = RuntimeError::PullStalled {
            image: "repo/big:1".into(),
            stalled_for: Duration::from_secs(300),
            done_bytes: 11_000 << 20,
            total_bytes: 11_571 << 20,
            total_known: true,
            elapsed: Duration::from_secs(1522),
            rate: 9 << 20,
        };
        assert_eq!(
            e.to_string(),
            "pulling image repo/big:1 stalled: nothing moved for 5m0s; 10.7 GiB of 11.3 GiB \
             (11534336000 of 12133072896 bytes) downloaded in 25m22s, average 9.0 MiB/s"
        );
        assert_eq!(e.message(), e.to_string());
        let e = RuntimeError::PullStalled {
            image: "x:1".into(),
            stalled_for: Duration::from_millis(2500),
            done_bytes: 100,
            total_bytes: 4096,
            total_known: false,
            elapsed: Duration::from_secs(3700),
            rate: 0,
        };
        assert_eq!(
            e.to_string(),
            "pulling image x:1 stalled: nothing moved for 2.5s; 100 B of at least 4.0 KiB (100 \
             of 4096 bytes) downloaded in 1h1m40s, average 0 B/s"
        );
    }
}
