//! Building the engine from the command line: the Docker runtime, the host's GPUs (or a fake
//! GPU host for tests), authorized_keys, block volumes, and `host_info.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shim_engine::{Deps, Engine};
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
    let runtime = DockerRuntime::connect()
        .await
        .context("cannot connect to the Docker daemon")?;
    // Docker's own data directory: host_info.json reports its filesystem's size, as upstream
    // (`runner/internal/shim/host/host.go`, `GetDiskSize` of `DockerRootDir`).
    let docker_root = match runtime.data_root().await {
        Ok(dir) => dir,
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "cannot read Docker's info; the disk size is reported as 0");
            None
        }
    };
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
    if config.service {
        spawn_host_info(home, docker_root, host_gpus.clone());
    }
    let mut deps = Deps::new(
        Arc::new(runtime),
        Arc::new(AuthorizedKeysManager::system()),
        Arc::new(BlockVolumes::new(
            VolumeConfig::with_root(&config.engine.volumes_root),
            commands,
        )),
    );
    deps.host_gpus = host_gpus;
    deps.fake_gpus = fake_gpus;
    deps.host_devices = HostDevices {
        infiniband: Path::new(shim_runtime::INFINIBAND_PATH).exists(),
        hugepages_1g: Path::new(shim_runtime::HUGEPAGES_1G_PATH).exists(),
    };
    let mut cfg = config.engine.clone();
    cfg.home = home.to_path_buf();
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
    Ok((engine, dcgm))
}

/// Writes `host_info.json` once, in the background. `docker_root` is Docker's data
/// directory (its disk size is reported; 0 when unknown, the file is still written).
fn spawn_host_info(home: &Path, docker_root: Option<PathBuf>, gpus: HostGpus) {
    let home = home.to_path_buf();
    tokio::spawn(async move {
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
