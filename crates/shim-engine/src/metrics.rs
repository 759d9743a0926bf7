//! The engine's own Prometheus metrics: [`crate::Engine::encode_metrics`] encodes them alone,
//! [`crate::Engine::register_metrics`] adds them to an embedder's registry (beside its own,
//! e.g. its build info as an `Info` metric).
//!
//! Built on `prometheus-client` (the Prometheus project's Rust client, re-exported as
//! [`crate::prometheus_client`] so an embedder's registry is of the same version): it has no
//! global registry, so an embedding agent can serve the engine's metrics beside its own, and
//! its types make a label set a Rust type. (The `metrics` facade with its exporter would
//! install a process-wide recorder, which a library should not do.)
//!
//! The counters and histograms are moved where things happen (the driver, the reconciler,
//! the metered runtime); the gauges below are read at scrape time from the task table, the
//! GPU lock and the reconciler's state, which the collector holds (and nothing more).
//!
//! | metric | type | what |
//! |---|---|---|
//! | `dstack_shim_tasks{status}` | gauge | tasks by status as the API shows it |
//! | `dstack_shim_tasks_submitted` | counter | submits accepted |
//! | `dstack_shim_tasks_terminated{reason}` | counter | terminations (durable); `other` for a reason of free text and past 64 distinct ones |
//! | `dstack_shim_submit_to_running_seconds` | histogram | submit → `running` visible |
//! | `dstack_shim_exit_to_terminated_seconds` | histogram | the container's exit → `terminated` visible; the exit's time is the `die` event's (dockerd's, a little after the container's `FinishedAt`) or, for an exit found by a list, `FinishedAt` |
//! | `dstack_shim_reconcile_cycle_seconds` | histogram | full reconcile cycles (one list each) |
//! | `dstack_shim_reconcile_last_success_timestamp_seconds` | gauge | the last successful full cycle |
//! | `dstack_shim_reconcile_last_success_age_seconds` | gauge | seconds since then (the readiness signal) |
//! | `dstack_shim_events_connected` | gauge | 1 while Docker's event stream is connected |
//! | `dstack_shim_events_reconnects` | counter | event stream (re)connections |
//! | `dstack_shim_events_received{kind}` | counter | container events handled |
//! | `dstack_shim_docker_requests{op}` | counter | Docker API requests |
//! | `dstack_shim_docker_errors{op,kind}` | counter | failed Docker requests, by error kind |
//! | `dstack_shim_pull_stalls` | counter | image pulls failed as stalled (no progress for `--pull-stall-timeout`) |
//! | `dstack_shim_state_write_seconds` | histogram | durable task.json writes (with submit's) |
//! | `dstack_shim_state_write_errors` | counter | failed task.json writes |
//! | `dstack_shim_gpus_locked` / `dstack_shim_gpus_total` | gauge | GPUs held by tasks / on the host |
//! | `dstack_shim_gpu_unhealthy{gpu,reason}` | gauge | 1 for each reason a GPU is kept from new tasks (DCGM health, `nvidia-smi -q` retired pages or row remapping, XIDs) |
//! | `dstack_shim_gpu_device_mode{mode}` | gauge | 1 for how GPUs reach containers now: `cdi`, `legacy`, `refused` (once decided: a GPU host at start-up) |
//! | `dstack_shim_host_key_tasks` | gauge | tasks holding host SSH key lines |
//! | `dstack_shim_volumes_mounted` | gauge | volumes held by tasks |
//! | `dstack_shim_pending_releases` | gauge | terminated tasks still holding something |
//! | `dstack_shim_unwritten_tasks` | gauge | tasks whose last state write failed (retried) |
//! | `dstack_shim_image_gc_freed_bytes_total` | counter | bytes image collection freed, measured on the file system after each removal (shared layers and names count what the disk got back) |
//! | `dstack_shim_image_gc_removed_images_total` | counter | images removed by image collection |
//! | `dstack_shim_image_pulls_without_room_total` | counter | pulls failed because the image could not fit |
//! | `dstack_shim_image_ledger_corrupt_total` | counter | image ledgers found unreadable at start-up and moved aside |
//! | `dstack_shim_image_fs_used_ratio` / `dstack_shim_image_fs_available_bytes` | gauge | the engine's data root's file system, when last measured |
//! | `dstack_shim_task_cpu_seconds_total{task_id}` | counter | CPU time of each running task's container (its cgroup) |
//! | `dstack_shim_task_memory_bytes{task_id}` | gauge | memory charged to each running task's container now |
//! | `dstack_shim_task_memory_peak_bytes{task_id}` | gauge | the most memory it had charged at once (cgroup v1, or v2 on Linux 5.19+) |
//! | `dstack_shim_task_oom_kills_total{task_id}` | counter | its processes the kernel's OOM killer ended (Linux 4.13+) |
//!
//! The per-task usage is read at scrape time from each running task's control group (see
//! `usage.rs`): a task shows once its group was located (one inspect per container, in the
//! background; the first scrape after a task starts may miss it).

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use shim_resources::GpuLock;
use shim_task::TaskStatus;

use crate::counters::Metrics;
use crate::gpus::{GpuHealthWatch, GpuPassing};
use crate::images::ImageGc;
use crate::reconcile::ReconcileState;
use crate::table::TaskTable;
use crate::usage::Usage;

/// What the engine's metrics read: its counters, and at scrape time the task table, the GPU
/// lock and the reconciler's state.
#[derive(Clone)]
pub(crate) struct Sources {
    /// The counters and histograms.
    pub(crate) metrics: Arc<Metrics>,
    /// Every task.
    pub(crate) table: Arc<TaskTable>,
    /// The GPU lock.
    pub(crate) gpus: Arc<GpuLock>,
    /// How GPUs reach containers.
    pub(crate) gpu_passing: Arc<GpuPassing>,
    /// The GPUs' health as last probed.
    pub(crate) gpu_health: Arc<GpuHealthWatch>,
    /// The reconciler's state.
    pub(crate) reconcile: Arc<ReconcileState>,
    /// Where running tasks' control groups are (the per-task usage).
    pub(crate) usage: Arc<Usage>,
    /// Image collection.
    pub(crate) images: Arc<ImageGc>,
}

/// Registers every metric of the engine in `registry`.
pub(crate) fn register(registry: &mut Registry, sources: &Sources) {
    sources.metrics.register(registry);
    registry.register_collector(Box::new(State(sources.clone())));
}

/// Gauges read at scrape time, from the sources themselves.
struct State(Sources);

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("tasks", &self.0.table.len())
            .finish_non_exhaustive()
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    let m = encoder.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = prometheus_client::metrics::counter::ConstCounter::new(value);
    let m = encoder.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

impl Collector for State {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let statuses = [
            TaskStatus::Pending,
            TaskStatus::Preparing,
            TaskStatus::Pulling,
            TaskStatus::Creating,
            TaskStatus::Running,
            TaskStatus::Terminated,
        ];
        let mut by_status = [0u64; 6];
        let (mut keys, mut volumes, mut pending, mut unwritten) = (0u64, 0u64, 0u64, 0u64);
        for slot in self.0.table.slots() {
            slot.read(|t| {
                if let Some(i) = statuses.iter().position(|s| *s == t.status()) {
                    by_status[i] += 1;
                }
                let r = &t.record().resources;
                if r.host_keys.is_some() {
                    keys += 1;
                }
                volumes += r.volumes.len() as u64;
                if t.record().status == TaskStatus::Terminated && r.holds_any() {
                    pending += 1;
                }
                if t.write_failed() {
                    unwritten += 1;
                }
            });
        }
        {
            let family: Family<StatusLabels, prometheus_client::metrics::gauge::Gauge> =
                Family::default();
            for (s, n) in statuses.iter().zip(by_status) {
                family
                    .get_or_create(&StatusLabels {
                        status: s.as_str().to_owned(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            let m = encoder.encode_descriptor(
                "dstack_shim_tasks",
                "Tasks by status as the API shows it",
                None,
                family.metric_type(),
            )?;
            family.encode(m)?;
        }
        gauge(
            &mut encoder,
            "dstack_shim_gpus_locked",
            "GPUs held by tasks",
            self.0.gpus.locked().len() as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_gpus_total",
            "GPUs on the host",
            self.0.gpus.total() as f64,
        )?;
        if let Some(mode) = self.0.gpu_passing.last_name() {
            let family: Family<ModeLabels, prometheus_client::metrics::gauge::Gauge> =
                Family::default();
            family
                .get_or_create(&ModeLabels {
                    mode: mode.to_owned(),
                })
                .set(1);
            let m = encoder.encode_descriptor(
                "dstack_shim_gpu_device_mode",
                "How GPUs reach containers now: cdi, legacy (upstream's device request and \
                 mappings) or refused (GPU tasks cannot get their GPUs; the log says why)",
                None,
                family.metric_type(),
            )?;
            family.encode(m)?;
        }
        if let Some(report) = self.0.gpu_health.last() {
            let family: Family<GpuReasonLabels, prometheus_client::metrics::gauge::Gauge> =
                Family::default();
            for gpu in report.unhealthy() {
                for reason in &gpu.reasons {
                    family
                        .get_or_create(&GpuReasonLabels {
                            gpu: gpu.uuid.clone(),
                            reason: reason.to_string(),
                        })
                        .set(1);
                }
            }
            let m = encoder.encode_descriptor(
                "dstack_shim_gpu_unhealthy",
                "1 for each reason a GPU is kept from new tasks (its health source marks it bad)",
                None,
                family.metric_type(),
            )?;
            family.encode(m)?;
        }
        gauge(
            &mut encoder,
            "dstack_shim_host_key_tasks",
            "Tasks holding host SSH key lines",
            keys as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_volumes_mounted",
            "Volumes held by tasks",
            volumes as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_pending_releases",
            "Terminated tasks still holding something (released by the reconciler)",
            pending as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_unwritten_tasks",
            "Tasks whose last state write failed (retried by the reconciler)",
            unwritten as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_events_connected",
            "1 while Docker's event stream is connected",
            if self.0.reconcile.events_connected() {
                1.0
            } else {
                0.0
            },
        )?;
        if let Some(last) = self.0.reconcile.last_cycle_ms() {
            gauge(
                &mut encoder,
                "dstack_shim_reconcile_last_success_timestamp_seconds",
                "Unix time of the last successful full reconcile cycle",
                last as f64 / 1000.0,
            )?;
            gauge(
                &mut encoder,
                "dstack_shim_reconcile_last_success_age_seconds",
                "Seconds since the last successful full reconcile cycle",
                self.0
                    .reconcile
                    .last_cycle_age()
                    .unwrap_or_default()
                    .as_secs_f64(),
            )?;
        }
        counter(
            &mut encoder,
            "dstack_shim_image_gc_freed_bytes",
            "Bytes image collection freed, measured on the file system after each removal",
            self.0.images.freed_bytes(),
        )?;
        counter(
            &mut encoder,
            "dstack_shim_image_gc_removed_images",
            "Unused images this shim pulled that image collection removed",
            self.0.images.removed_images(),
        )?;
        counter(
            &mut encoder,
            "dstack_shim_image_pulls_without_room",
            "Pulls failed because the image could not fit on the engine's disk after collection",
            self.0.images.no_room_failures(),
        )?;
        counter(
            &mut encoder,
            "dstack_shim_image_ledger_corrupt",
            "Image ledgers found unreadable at start-up and moved aside (images.json.corrupt-<ms>)",
            self.0.images.corrupt_ledgers(),
        )?;
        if let Some(u) = self.0.images.last_usage() {
            gauge(
                &mut encoder,
                "dstack_shim_image_fs_used_ratio",
                "How full the file system of the engine's data root was when last measured (0-1)",
                u.used_percent() / 100.0,
            )?;
            gauge(
                &mut encoder,
                "dstack_shim_image_fs_available_bytes",
                "Bytes available on the file system of the engine's data root when last measured",
                u.available as f64,
            )?;
        }
        self.0.usage.encode(&mut encoder)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuReasonLabels {
    gpu: String,
    reason: String,
}
