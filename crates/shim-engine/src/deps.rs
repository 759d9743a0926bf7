//! The external systems the engine works with ([`Deps`]).

use std::sync::Arc;

use shim_resources::cgroup::Cgroups;
use shim_resources::gpu::{GpuHealthSource, Kmsg, NvidiaHealth, XidMonitor, XidPolicy};
use shim_resources::host::{FsProbe, HostFs};
use shim_resources::{
    AuthorizedKeys, AuthorizedKeysManager, BlockVolumes, GpuDetector, GpuVendor, HostGpus,
    VolumeConfig, VolumeManager,
};
use shim_runtime::{ContainerRuntime, HostDevices};
use shim_util::SystemCommandRunner;

use crate::Clock;

/// The external systems the engine works with: real implementations for an agent, fakes for
/// tests.
///
/// [`Deps::new`] takes the three it cannot do without; the host's GPUs and device facts
/// default to none. `#[non_exhaustive]`: set the other fields after `new`; a field added in a
/// later version breaks no embedder.
#[derive(Clone)]
#[non_exhaustive]
pub struct Deps {
    /// The container runtime (Docker).
    pub runtime: Arc<dyn ContainerRuntime>,
    /// The host's GPUs (detected, or a fake host); the engine keeps its lock over exactly
    /// these. Default: none.
    pub host_gpus: HostGpus,
    /// When true the GPUs are accounted for but not passed to containers (a fake GPU host).
    /// Default: false.
    pub fake_gpus: bool,
    /// The host users' authorized_keys.
    pub keys: Arc<dyn AuthorizedKeys>,
    /// Block volumes.
    pub volumes: Arc<dyn VolumeManager>,
    /// Host device facts for the container spec: `None` looks at the host at each create
    /// ([`HostDevices::probe`], as upstream does: a `/dev/infiniband` that appears or goes
    /// after the shim started counts from the next create). Default: `Some`, no InfiniBand,
    /// no 1 GiB hugepages.
    pub host_devices: Option<HostDevices>,
    /// Where containers' control groups are read for the per-task usage metrics. Default:
    /// the host's (`/sys/fs/cgroup`, `/proc`).
    pub cgroups: Cgroups,
    /// The clock records, metrics and the image ledger are stamped with. Default: the
    /// host's ([`Clock::system`]); tests on tokio's paused time use [`Clock::tokio_from`].
    pub clock: Clock,
    /// How full the container engine's data root is (image collection). Default: the host's
    /// ([`HostFs`]).
    pub fs: Arc<dyn FsProbe>,
    /// Where the GPUs' health comes from (an NVIDIA host: `nvidia-smi -q` and XIDs,
    /// [`shim_resources::gpu::NvidiaHealth`]); an unhealthy GPU is kept from new tasks.
    /// Default: none (every GPU healthy).
    pub gpu_health: Option<Arc<dyn GpuHealthSource>>,
    /// Reads the GPUs' interconnect (`nvidia-smi topo -m`) once, in the background, when the
    /// engine opens: the GPU lock places tasks by it from then on (first-free until then, or
    /// for good when it cannot be read). Default: none (first-free).
    pub gpu_topology: Option<Arc<GpuDetector>>,
    /// Faults injected into the task store's writes (feature `test-support`): a test makes
    /// the home's disk full with [`shim_fs::fault::Faults::set_full`]. Default: none.
    #[cfg(feature = "test-support")]
    pub store_faults: Option<Arc<shim_fs::fault::Faults>>,
}

/// How [`Deps::for_host`] sets an agent up on the host it runs on.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HostOptions {
    /// Where block volumes are mounted.
    pub volumes: VolumeConfig,
    /// A fake GPU host of this many GPUs instead of detecting the host's (accounted for, not
    /// passed to containers: tests and demos).
    pub fake_gpus: Option<u32>,
    /// Watch the GPUs' health (an NVIDIA host).
    pub gpu_health: bool,
    /// Which XIDs make a GPU unhealthy.
    pub xid_policy: XidPolicy,
}

impl HostOptions {
    /// Volumes under `volumes_root`, the host's own GPUs, their health watched by NVIDIA's
    /// device plugin's rule.
    pub fn new(volumes_root: impl Into<std::path::PathBuf>) -> Self {
        Self {
            volumes: VolumeConfig::with_root(volumes_root),
            fake_gpus: None,
            gpu_health: true,
            xid_policy: XidPolicy::default(),
        }
    }
}

impl Deps {
    /// The engine's dependencies on a host without GPUs or special devices.
    pub fn new(
        runtime: Arc<dyn ContainerRuntime>,
        keys: Arc<dyn AuthorizedKeys>,
        volumes: Arc<dyn VolumeManager>,
    ) -> Self {
        Self {
            runtime,
            host_gpus: HostGpus::none(),
            fake_gpus: false,
            keys,
            volumes,
            host_devices: Some(HostDevices::default()),
            cgroups: Cgroups::system(),
            clock: Clock::system(),
            fs: Arc::new(HostFs),
            gpu_health: None,
            gpu_topology: None,
            #[cfg(feature = "test-support")]
            store_faults: None,
        }
    }

    /// The dependencies of an agent on the host it runs on, probed as `dstack-shim` probes
    /// them: the host users' `authorized_keys`, block volumes, the GPUs (the vendor from
    /// device paths, listed with its tool; or a fake host), the InfiniBand and hugepage
    /// devices, and on an NVIDIA host the GPUs' health (`nvidia-smi -q` and the kernel log's
    /// XIDs) and interconnect. Host tools run through one [`SystemCommandRunner`].
    pub async fn for_host(runtime: Arc<dyn ContainerRuntime>, options: &HostOptions) -> Self {
        let commands = Arc::new(SystemCommandRunner::default());
        let (host_gpus, fake_gpus) = match options.fake_gpus {
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
        let nvidia =
            !fake_gpus && host_gpus.vendor == Some(GpuVendor::Nvidia) && !host_gpus.gpus.is_empty();
        let mut deps = Self::new(
            runtime,
            Arc::new(AuthorizedKeysManager::system()),
            Arc::new(BlockVolumes::new(options.volumes.clone(), commands.clone())),
        );
        deps.host_gpus = host_gpus;
        deps.fake_gpus = fake_gpus;
        deps.host_devices = None;
        if nvidia {
            if options.gpu_health {
                let xids = XidMonitor::new(Arc::new(Kmsg::default()), options.xid_policy.clone());
                deps.gpu_health = Some(Arc::new(NvidiaHealth::new(commands.clone(), xids)));
            }
            deps.gpu_topology = Some(Arc::new(GpuDetector::new(commands)));
        }
        deps
    }
}
