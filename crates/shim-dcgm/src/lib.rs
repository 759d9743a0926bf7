//! NVIDIA DCGM for the shim, as upstream offers it on NVIDIA hosts: per-task GPU metrics from
//! `dcgm-exporter` and instance health from DCGM's health watches.
//!
//! - [`DcgmExporter`] runs `dcgm-exporter` as a child process (upstream's command line and
//!   collectors), restarts it with backoff when it exits, logs its output at debug level and
//!   stops it on shutdown (killed if the handle is dropped). [`DcgmExporter::fetch_task_metrics`]
//!   answers `GET /metrics/tasks/{id}`: the exporter's samples of the task's GPUs only.
//! - [`DcgmHealth`] answers `GET /api/instance/health` through `dcgmi` (upstream links
//!   libdcgm, which a Rust binary without cgo cannot), mapped to upstream's JSON shape
//!   ([`Health`]). Without `--dcgm-address` it runs a private `nv-hostengine`, the counterpart
//!   of upstream's embedded host engine.
//! - [`Dcgm`] starts both the way upstream's `main.go` does: only on NVIDIA hosts, each only
//!   when its programs are found. Absent parts stay `None`: metrics then answer 404 and health
//!   `{"dcgm":null}`.
//!
//! What the API answers, by case (upstream `runner/internal/shim/api/handlers.go`):
//!
//! | case | `/metrics/tasks/{id}` | `/api/instance/health` |
//! |---|---|---|
//! | not NVIDIA, or program missing | 404 | `{"dcgm":null}` |
//! | no such task | 404 (checked after the exporter) | — |
//! | exporter/dcgmi failed | 502 ([`DcgmErrorKind::Upstream`]) | `{"dcgm":null}`, error logged |
//! | fine | 200, filtered Prometheus text (empty without GPUs) | `{"dcgm":{...}}` |
//!
//! Settings: [`DcgmConfig`] (the binary maps upstream's `--dcgm-exporter-http-port`,
//! `--dcgm-exporter-interval`, `--dcgm-address` and their `DSTACK_*` variables onto it).

mod config;
mod counters;
mod error;
mod exporter;
mod health;
mod prom;
mod scratch;
mod supervisor;

pub use config::{
    Backoff, DCGMI_PROGRAM, DEFAULT_EXPORTER_HTTP_PORT, DEFAULT_EXPORTER_INTERVAL_MS, DcgmConfig,
    EXPORTER_PROGRAM, HOSTENGINE_PROGRAM, find_program,
};
pub use counters::{COUNTERS, Counter, counters_csv};
pub use error::{DcgmError, DcgmErrorKind};
pub use exporter::DcgmExporter;
pub use health::{
    DcgmHealth, HEALTH_FAIL, HEALTH_PASS, HEALTH_WARN, Health, HealthIncident, InstanceHealth,
    LAST_HEALTH_MAX_AGE, parse_dcgmi_health,
};
pub use prom::{ParseError, Sample, UUID_LABELS, filter_metrics, parse_sample};

/// The DCGM parts the shim runs, each present only when usable.
#[derive(Debug, Default)]
pub struct Dcgm {
    /// The exporter behind `/metrics/tasks/{id}`; `None`: 404.
    pub exporter: Option<DcgmExporter>,
    /// The health behind `/api/instance/health`; `None`: `{"dcgm":null}`.
    pub health: Option<DcgmHealth>,
}

impl Dcgm {
    /// Upstream's start-up (`runner/cmd/shim/main.go`): nothing unless the host is NVIDIA
    /// (`nvidia`: the caller's vendor detection, upstream checks `/dev/nvidiactl`); then the
    /// exporter ([`DcgmExporter::start`]) and health ([`DcgmHealth::start`]), independently.
    /// Never fails: what cannot start is logged and left out.
    pub async fn start(config: &DcgmConfig, nvidia: bool) -> Self {
        if !nvidia {
            return Self::default();
        }
        Self {
            exporter: DcgmExporter::start(config).await,
            health: DcgmHealth::start(config).await,
        }
    }

    /// Stops what runs (exporter, private host engine). Takes `&self` so that the API can
    /// share the `Dcgm` (in an `Arc`) while the binary still stops it at the end; later calls
    /// do nothing. Dropping a `Dcgm` without this kills the children (SIGKILL).
    pub async fn shutdown(&self) {
        if let Some(exporter) = &self.exporter {
            exporter.shutdown().await;
        }
        if let Some(health) = &self.health {
            health.shutdown().await;
        }
    }
}

/// Takes what `slot` holds (a child's task, a temporary file to remove at shutdown), leaving
/// `None`; a poisoned lock still gives it up.
pub(crate) fn take<T>(slot: &std::sync::Mutex<Option<T>>) -> Option<T> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
