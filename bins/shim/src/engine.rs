//! Building the engine from the command line: the Docker runtime, the host's GPUs (or a fake
//! GPU host for tests), authorized_keys, block volumes, and `host_info.json`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shim_engine::{Deps, Engine};
use shim_resources::gpu::{
    GpuHealthReport, GpuHealthSource, GpuRef, Kmsg, NvidiaHealth, UnhealthyReason, XidMonitor,
};
use shim_resources::{
    AuthorizedKeysManager, BlockVolumes, GpuDetector, GpuVendor, HostGpus, VolumeConfig,
};
use shim_runtime::{ContainerRuntime as _, DockerRuntime, HostDevices};
use shim_util::SystemCommandRunner;
use shim_util::error_chain;

use crate::config::Config;

/// How long a graceful shutdown waits for start jobs in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Connects to Docker, detects the host, starts DCGM on NVIDIA hosts, restores tasks and
/// runs the first reconcile cycle.
pub async fn open(config: &Config, home: &Path) -> anyhow::Result<(Engine, Arc<shim_dcgm::Dcgm>)> {
    let runtime = Arc::new(
        DockerRuntime::connect()
            .await
            .context("cannot connect to the Docker daemon")?,
    );
    let commands = Arc::new(SystemCommandRunner::default());
    let (host_gpus, fake_gpus) = match config.fake_gpus {
        Some(n) => (HostGpus::fake_nvidia(n), true),
        None => (GpuDetector::new(commands.clone()).detect().await, false),
    };
    tracing::info!(
        vendor = ?host_gpus.vendor,
        driver = ?host_gpus.driver_version,
        count = host_gpus.gpus.len(),
        fake = fake_gpus,
        "GPUs"
    );
    let nvidia = config.fake_gpus.is_none() && host_gpus.vendor == Some(GpuVendor::Nvidia);
    let dcgm_config = shim_dcgm::DcgmConfig {
        log_dir: Some(home.to_path_buf()),
        state_dir: Some(home.to_path_buf()),
        ..config.dcgm.clone()
    };
    let dcgm = Arc::new(shim_dcgm::Dcgm::start(&dcgm_config, nvidia).await);
    let watch_health = nvidia && !host_gpus.gpus.is_empty();
    if config.service {
        spawn_host_info(home, runtime.clone(), host_gpus.clone());
    }
    let mut deps = Deps::new(
        runtime,
        Arc::new(AuthorizedKeysManager::system()),
        Arc::new(BlockVolumes::new(
            VolumeConfig::with_root(&config.engine.volumes_root),
            commands.clone(),
        )),
    );
    deps.host_gpus = host_gpus;
    deps.fake_gpus = fake_gpus;
    if watch_health && config.gpu_health_interval.is_some() {
        let xids = XidMonitor::new(Arc::new(Kmsg::default()), config.xid_policy.clone());
        deps.gpu_health = Some(Arc::new(HostGpuHealth {
            nvidia: NvidiaHealth::new(commands.clone(), xids),
            dcgm: dcgm.clone(),
        }));
    }
    deps.host_devices = HostDevices {
        infiniband: Path::new(shim_runtime::INFINIBAND_PATH).exists(),
        hugepages_1g: Path::new(shim_runtime::HUGEPAGES_1G_PATH).exists(),
    };
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
    let engine = Engine::open(cfg, deps)
        .await
        .context("cannot restore tasks")?;
    tracing::info!(
        tasks = engine.list().len(),
        owner = engine.owner(),
        "engine ready"
    );
    if watch_health {
        spawn_topology(engine.clone(), GpuDetector::new(commands));
    }
    Ok((engine, dcgm))
}

/// Reads the GPUs' interconnect (`nvidia-smi topo -m`) once, in the background, and gives it
/// to the GPU lock, which places tasks by it from then on (first-free until then, or for good
/// when it cannot be read).
fn spawn_topology(engine: shim_engine::Engine, detector: GpuDetector) {
    tokio::spawn(async move {
        match detector.topology().await {
            Ok(topology) => {
                tracing::info!(
                    gpus = topology.gpus().len(),
                    "GPU interconnect read: tasks get their GPUs by it (one NUMA node where one can hold them, then the best links)"
                );
                engine.gpu_lock().set_topology(Some(topology));
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot read the GPU interconnect: GPUs are handed out first-free");
            }
        }
    });
}

/// The host's GPU health: `nvidia-smi -q` and XIDs ([`NvidiaHealth`]), and DCGM's failed
/// health watches where DCGM runs (an incident of health `FAIL` on a GPU entity makes that
/// GPU unhealthy).
struct HostGpuHealth {
    nvidia: NvidiaHealth,
    dcgm: Arc<shim_dcgm::Dcgm>,
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
        let mut report = self.nvidia.probe().await;
        if let Some(health) = &self.dcgm.health
            && let Some(dcgm) = health.instance_health().await.dcgm
        {
            for incident in dcgm.incidents {
                // Entity group 1: a GPU, by its DCGM id (nvidia-smi's index).
                if incident.entity_group_id == 1 && incident.health == shim_dcgm::HEALTH_FAIL {
                    report.add_reason(
                        GpuRef::Index(incident.entity_id),
                        UnhealthyReason::dcgm(dcgm_system(incident.system), incident.error_message),
                    );
                }
            }
        }
        report
    }
}

/// Writes `host_info.json` once, in the background. `docker_root` is Docker's data
/// directory (its disk size is reported; 0 when unknown, the file is still written).
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
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %error_chain(&e), "cannot write host info"),
            Err(e) => tracing::warn!(error = %e, "host info job failed"),
        }
    });
}
