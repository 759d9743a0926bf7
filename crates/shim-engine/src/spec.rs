//! From a task to the runtime-neutral container inputs (SPEC §6).

use std::collections::BTreeMap;
use std::path::PathBuf;

use shim_resources::{GpuVendor, VolumeManager};
use shim_runtime::{
    BindMount, ContainerInputs, ContainerSpec, DeviceMapping, GpuConfig, HostDevices, RunnerParams,
    build_container_spec,
};
use shim_task::machine::Task;
use shim_task::{NetworkMode, TaskConfig};

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::gpus::Passing;
use crate::home::Home;
use crate::labels::{LABEL_GPUS, LABEL_IS_TASK, LABEL_OWNER, LABEL_TASK_ID};

/// What a task's container spec depends on besides the task.
pub(crate) struct SpecContext<'a> {
    /// The engine's configuration (runner, environment, privileges).
    pub(crate) cfg: &'a EngineConfig,
    /// The owner identity (a label).
    pub(crate) owner: &'a str,
    /// Where the task's directory is.
    pub(crate) home: &'a Home,
    /// Where volumes are mounted.
    pub(crate) volumes: &'a dyn VolumeManager,
    /// The host's GPU vendor.
    pub(crate) gpu_vendor: Option<GpuVendor>,
    /// GPUs are accounted for but not passed to containers (a fake GPU host).
    pub(crate) fake_gpus: bool,
    /// Host device facts.
    pub(crate) host_devices: HostDevices,
    /// How GPUs go to containers now.
    pub(crate) passing: &'a Passing,
}

/// The container spec of a task that has a config (start only runs for those).
pub(crate) fn container_spec(ctx: &SpecContext<'_>, task: &Task) -> Result<ContainerSpec> {
    let config = task
        .record()
        .config
        .as_ref()
        .ok_or_else(|| EngineError::WrongStatus {
            id: task.record().id.clone(),
            status: task.record().status,
        })?;
    let paths = ctx.home.paths(&task.record().container_name)?;
    Ok(build_container_spec(&inputs(
        ctx,
        task,
        config,
        paths.runner_dir,
    )?))
}

fn inputs(
    ctx: &SpecContext<'_>,
    task: &Task,
    config: &TaskConfig,
    runner_dir: PathBuf,
) -> Result<ContainerInputs> {
    let cfg = ctx.cfg;
    let gpus = &task.record().resources.gpus;
    let mut labels = BTreeMap::new();
    labels.insert(LABEL_IS_TASK.to_owned(), "true".to_owned());
    labels.insert(LABEL_TASK_ID.to_owned(), task.record().id.to_string());
    labels.insert(LABEL_OWNER.to_owned(), ctx.owner.to_owned());
    // Set even when empty: a create's labels win over the image's, and an image made from a
    // task's container (`docker commit` keeps its labels) would otherwise lend a task without
    // GPUs that container's GPU ids, which a restore believes.
    labels.insert(LABEL_GPUS.to_owned(), gpus.join(","));
    let network = config.network_mode;
    let mut mounts = Vec::new();
    for m in &config.volume_mounts {
        let source = task
            .record()
            .resources
            .volumes
            .iter()
            .find(|v| v.name == m.name.as_str())
            .map(|v| PathBuf::from(&v.mount_point))
            .unwrap_or_else(|| ctx.volumes.mount_point(m.name.as_str()));
        mounts.push(BindMount {
            source,
            target: m.path.clone(),
            read_only: false,
        });
    }
    for m in &config.instance_mounts {
        mounts.push(BindMount {
            source: PathBuf::from(&m.instance_path),
            target: m.path.clone(),
            read_only: false,
        });
    }
    let env = cfg
        .pass_env
        .iter()
        .filter_map(|name| std::env::var(name).ok().map(|v| (name.clone(), v)))
        .collect();
    // `gpu_devices` replace the vendor logic, and only when the task acquired GPUs (upstream
    // `runner/internal/shim/docker.go`, `createContainer`: `if len(task.gpuIDs) > 0`).
    let gpu = if !gpus.is_empty() && !config.gpu_devices.is_empty() {
        GpuConfig::Devices(
            config
                .gpu_devices
                .iter()
                .map(|d| DeviceMapping {
                    path_on_host: d.path_on_host.clone(),
                    path_in_container: d.path_in_container.clone(),
                    cgroup_permissions: "rwm".to_owned(),
                })
                .collect(),
        )
    } else if gpus.is_empty() || ctx.fake_gpus {
        GpuConfig::None
    } else {
        match (ctx.gpu_vendor, ctx.passing) {
            (Some(GpuVendor::Nvidia | GpuVendor::Amd), Passing::Refused(message)) => {
                return Err(EngineError::GpusUnavailable {
                    message: message.clone(),
                });
            }
            (Some(vendor @ (GpuVendor::Nvidia | GpuVendor::Amd)), Passing::Cdi(names)) => {
                let devices = gpus
                    .iter()
                    .map(|id| {
                        names
                            .get(id)
                            .cloned()
                            .ok_or_else(|| EngineError::GpusUnavailable {
                                message: format!("GPU {id} has no CDI name"),
                            })
                    })
                    .collect::<Result<Vec<_>>>()?;
                GpuConfig::Cdi {
                    devices,
                    amd: vendor == GpuVendor::Amd,
                }
            }
            (Some(GpuVendor::Nvidia), _) => GpuConfig::Nvidia {
                uuids: gpus.clone(),
            },
            (Some(GpuVendor::Amd), _) => GpuConfig::Amd {
                render_nodes: gpus.clone(),
            },
            (Some(GpuVendor::Tenstorrent), _) => GpuConfig::Tenstorrent { ids: gpus.clone() },
            (Some(GpuVendor::Intel), _) => GpuConfig::Intel { ids: gpus.clone() },
            (None, _) => GpuConfig::None,
        }
    };
    Ok(ContainerInputs {
        name: task.record().container_name.clone(),
        image: shim_runtime::with_default_tag(&config.image_name),
        labels,
        runner: RunnerParams {
            binary_host_path: cfg.runner_binary_path.clone(),
            dir_host_path: runner_dir,
            http_port: cfg.runner_http_port,
            ssh_port: cfg.runner_ssh_port,
            log_level: cfg.runner_log_level.clone(),
            ssh_log_level: cfg.runner_ssh_log_level.clone(),
            http_address_localhost: network == NetworkMode::Host,
            authorized_keys: config
                .container_ssh_keys
                .iter()
                .map(|k| k.as_str().to_owned())
                .collect(),
        },
        network,
        user: config.effective_user().to_owned(),
        privileged: config.privileged || cfg.privileged,
        nano_cpus: shim_runtime::nano_cpus(config.cpu),
        memory: config.memory,
        shm_size: config.shm_size,
        mounts,
        env,
        pjrt_device: cfg.pjrt_device.clone(),
        gpu,
        host: ctx.host_devices,
        log: cfg.container_log,
    })
}
