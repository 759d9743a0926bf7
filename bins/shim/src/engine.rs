//! Building the engine from the command line: the Docker runtime, the host as the engine
//! library probes it (`Deps::for_host`: GPUs or a fake GPU host for tests, authorized_keys,
//! block volumes, devices, GPU health and interconnect), DCGM's health joined to the GPUs'
//! own, and `host_info.json`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shim_engine::{Clock, Deps, Engine, HostOptions};
use shim_resources::gpu::{
    GpuHealth, GpuHealthReport, GpuHealthSource, HealthSource, UnhealthyReason,
};
use shim_resources::{GpuVendor, HostGpus};
use shim_runtime::{ContainerRuntime as _, DockerRuntime};
use shim_util::error_chain;
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// How long a graceful shutdown waits for start jobs in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How long start-up waits for Docker to answer (the engine's start-up list waits as long).
const DOCKER_WAIT: Duration = Duration::from_secs(60);

/// A stop signal came while start-up waited for Docker.
#[derive(Debug, thiserror::Error)]
#[error("stopped by a signal while waiting for the Docker daemon")]
pub struct StoppedWaiting;

/// `attempt`'s answer, tried again every second while it fails, until `deadline` or until
/// `stop` ([`StoppedWaiting`]).
async fn until_docker_answers<T, E>(
    deadline: tokio::time::Instant,
    stop: &CancellationToken,
    mut attempt: impl AsyncFnMut() -> Result<T, E>,
) -> anyhow::Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
{
    loop {
        let answer = tokio::select! {
            answer = attempt() => answer,
            () = stop.cancelled() => return Err(StoppedWaiting.into()),
        };
        match answer {
            Ok(answer) => return Ok(answer),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %error_chain(&e), "the Docker daemon does not answer yet; trying again");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = stop.cancelled() => return Err(StoppedWaiting.into()),
                }
            }
            Err(e) => return Err(e).context("cannot connect to the Docker daemon"),
        }
    }
}

/// Connects to Docker, detects the host, starts DCGM on NVIDIA hosts, restores tasks and
/// runs the first reconcile cycle.
pub async fn open(
    config: &Config,
    home: &Path,
    stop: &CancellationToken,
) -> anyhow::Result<(Engine, Arc<shim_dcgm::Dcgm>)> {
    // Docker is waited for a while, as the start-up list waits for it: one restarted by an
    // operator or a package upgrade while this shim starts (an upgrade in place's new binary,
    // whose watchdog would otherwise roll it back for Docker's doing) is no failed start.
    let deadline = tokio::time::Instant::now() + DOCKER_WAIT;
    let runtime = Arc::new(
        until_docker_answers(deadline, stop, async || DockerRuntime::unconnected()).await?,
    );
    // The start-up list goes out first, side by side with the engine's `/version` and before
    // the GPUs are detected (`nvidia-smi` may take a while): a restart takes about one list.
    let opening = Engine::begin(runtime.clone(), Clock::system());
    until_docker_answers(deadline, stop, async || runtime.identify().await).await?;
    let mut options = HostOptions::new(&config.engine.volumes_root);
    options.fake_gpus = config.fake_gpus;
    options.gpu_health = config.gpu_health_interval.is_some();
    options.xid_policy = config.xid_policy.clone();
    let mut deps = Deps::for_host(runtime.clone(), &options).await;
    let nvidia = !deps.fake_gpus && deps.host_gpus.vendor == Some(GpuVendor::Nvidia);
    let dcgm_config = shim_dcgm::DcgmConfig {
        log_dir: Some(home.to_path_buf()),
        state_dir: Some(home.to_path_buf()),
        ..config.dcgm.clone()
    };
    let dcgm = Arc::new(shim_dcgm::Dcgm::start(&dcgm_config, nvidia).await);
    if config.service {
        spawn_host_info(home, runtime, deps.host_gpus.clone());
    }
    // DCGM's failed health watches join the host's own health sources.
    if let Some(host) = deps.gpu_health.take() {
        let uuids = (deps.host_gpus.gpus.iter())
            .map(|g| (g.index, g.id.clone()))
            .collect();
        deps.gpu_health = Some(Arc::new(HostGpuHealth {
            host,
            dcgm: dcgm.clone(),
            uuids,
        }));
    }
    let mut cfg = config.engine.clone();
    cfg.home = home.to_path_buf();
    if let Some(every) = config.gpu_health_interval {
        cfg.gpu_health_interval = every;
    }
    tracing::info!(
        high_percent = cfg.image_gc_high_percent,
        low_percent = cfg.image_gc_low_percent,
        "unused images this shim pulled are collected above the high mark, down to the low one (high 100: never)"
    );
    tracing::info!(
        stall_timeout = ?cfg.pull_stall_timeout,
        timeout = ?cfg.pull_timeout,
        "image pulls fail after the stall timeout without progress, or the timeout in all (None: no limit)"
    );
    match &cfg.container_log {
        Some(limits) => tracing::info!(
            log_config = %limits,
            bytes_per_container = limits.total_bytes(),
            "container logs are bounded"
        ),
        None => tracing::info!(
            "container logs: the daemon's own log configuration (--container-log-max-size daemon)"
        ),
    }
    let engine = opening
        .open(cfg, deps)
        .await
        .context("cannot restore tasks")?;
    let tasks = engine.list();
    let running = tasks
        .iter()
        .filter(|(_, status)| *status == shim_task::TaskStatus::Running)
        .count();
    tracing::info!(
        tasks = tasks.len(),
        running,
        owner = engine.owner(),
        "engine ready"
    );
    Ok((engine, dcgm))
}

/// The host's GPU health: its own sources (`nvidia-smi -q` and XIDs: `Deps::for_host`), and
/// DCGM's failed health watches where DCGM runs (an incident of health `FAIL` on a GPU entity
/// makes that GPU unhealthy).
struct HostGpuHealth {
    host: Arc<dyn GpuHealthSource>,
    dcgm: Arc<shim_dcgm::Dcgm>,
    /// The UUID of each GPU by its index as `nvidia-smi` gave it at detection (DCGM's GPU
    /// id): an incident goes to that UUID, not to the GPU at that position of a health probe's
    /// list, which a GPU `nvidia-smi -q` could not read shifts.
    uuids: std::collections::BTreeMap<u32, String>,
}

/// Adds DCGM's `reason` to its GPU entity `id` in `report`: the GPU detection gave that index
/// (`uuids`), listed in the report if `nvidia-smi -q` could not read it (DCGM's incident on a
/// GPU the driver lost must still keep it out). An index detection does not know is logged and
/// left: it is no position in the report's list.
fn add_dcgm_incident(
    report: &mut GpuHealthReport,
    uuids: &std::collections::BTreeMap<u32, String>,
    id: u32,
    reason: UnhealthyReason,
) {
    let Some(uuid) = uuids.get(&id) else {
        tracing::warn!(gpu = id, %reason, "DCGM reports a GPU the shim did not detect; left out");
        return;
    };
    let listed = GpuHealth {
        uuid: uuid.clone(),
        index: id,
        bus_id: String::new(),
        reasons: Vec::new(),
    };
    report.add_reason_listed(&listed, reason);
}

/// DCGM's health watch system, by its bit (`dcgmHealthSystems_t`).
fn dcgm_system(bit: u32) -> String {
    match bit {
        0x1 => "PCIe".to_owned(),
        0x2 => "NVLink".to_owned(),
        0x4 => "PMU".to_owned(),
        0x8 => "MCU".to_owned(),
        0x10 => "memory".to_owned(),
        0x20 => "SM".to_owned(),
        0x40 => "InfoROM".to_owned(),
        0x80 => "thermal".to_owned(),
        0x100 => "power".to_owned(),
        0x200 => "driver".to_owned(),
        0x1000 => "ConnectX".to_owned(),
        other => format!("system {other:#x}"),
    }
}

#[async_trait::async_trait]
impl GpuHealthSource for HostGpuHealth {
    async fn probe(&self) -> GpuHealthReport {
        let mut report = self.host.probe().await;
        let Some(health) = &self.dcgm.health else {
            return report;
        };
        let Some(dcgm) = health.instance_health().await.dcgm else {
            // Partial: a GPU DCGM marked bad must not read as healthy again for it.
            report.unreadable(HealthSource::Dcgm, "DCGM's health check could not be read");
            return report;
        };
        {
            for incident in dcgm.incidents {
                // Entity group 1: a GPU, by its DCGM id (nvidia-smi's index).
                if incident.entity_group_id == 1 && incident.health == shim_dcgm::HEALTH_FAIL {
                    let reason =
                        UnhealthyReason::dcgm(dcgm_system(incident.system), incident.error_message);
                    add_dcgm_incident(&mut report, &self.uuids, incident.entity_id, reason);
                }
            }
        }
        report
    }
}

/// Writes `host_info.json` in the background (once: an existing one is kept), with the size
/// of Docker's data directory's filesystem, as upstream (`runner/internal/shim/host/host.go`,
/// `GetDiskSize` of `DockerRootDir`). Docker's `/info` is asked here, off the start-up path: it
/// is one of the daemon's slower answers.
fn spawn_host_info(home: &Path, runtime: Arc<DockerRuntime>, gpus: HostGpus) {
    let home = home.to_path_buf();
    tokio::spawn(async move {
        let docker_root = match runtime.data_root().await {
            Ok(dir) => dir,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot read Docker's info; the disk size is reported as 0");
                None
            }
        };
        let written = tokio::task::spawn_blocking(move || {
            let root = docker_root.unwrap_or_default();
            shim_resources::write_host_info(&home, &root, &gpus)
        })
        .await;
        match written {
            Ok(Ok((path, true))) => tracing::info!(path = %path.display(), "host info written"),
            Ok(Ok((path, false))) => {
                tracing::info!(path = %path.display(), "host info kept (written at an earlier start)");
            }
            Ok(Err(e)) => tracing::warn!(error = %error_chain(&e), "cannot write host info"),
            Err(e) => tracing::warn!(error = %e, "host info job failed"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DCGM incident names the GPU by its index; the shim goes by the UUID detection gave
    /// that index: a GPU missing from a health probe's list (`nvidia-smi -q` lost it) shifts
    /// nothing and is listed with the reason; an index detection does not know goes nowhere.
    #[test]
    fn a_dcgm_incident_goes_to_the_gpu_detection_numbered_so() {
        let uuids = [(0, "GPU-a"), (1, "GPU-b"), (3, "GPU-d")]
            .map(|(i, u)| (i, u.to_owned()))
            .into();
        let gpu = |uuid: &str, index| GpuHealth {
            uuid: uuid.into(),
            index,
            bus_id: String::new(),
            reasons: Vec::new(),
        };
        // GPU 2 lost at detection; `-q` lists the others at positions 0, 1, 2.
        let mut report = GpuHealthReport {
            gpus: vec![gpu("GPU-a", 0), gpu("GPU-b", 1), gpu("GPU-d", 2)],
            ..GpuHealthReport::default()
        };
        let reason = || UnhealthyReason::dcgm("memory", "ECC errors");
        add_dcgm_incident(&mut report, &uuids, 2, reason());
        assert!(report.unhealthy_ids().is_empty(), "{report:?}");
        add_dcgm_incident(&mut report, &uuids, 3, reason());
        assert_eq!(report.unhealthy_ids(), ["GPU-d"]);
        // `-q` could not read GPU-b: DCGM's incident lists it.
        report.gpus.retain(|g| g.uuid != "GPU-b");
        add_dcgm_incident(&mut report, &uuids, 1, reason());
        assert_eq!(report.unhealthy_ids(), ["GPU-b", "GPU-d"]);
    }
}
