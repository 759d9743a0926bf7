//! The external systems the engine works with ([`Deps`]).

use std::sync::Arc;

use shim_resources::cgroup::Cgroups;
use shim_resources::gpu::GpuHealthSource;
use shim_resources::host::{FsProbe, HostFs};
use shim_resources::{AuthorizedKeys, HostGpus, VolumeManager};
use shim_runtime::{ContainerRuntime, HostDevices};

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
    /// Host device facts for the container spec. Default: no InfiniBand, no 1 GiB hugepages.
    pub host_devices: HostDevices,
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
            host_devices: HostDevices::default(),
            cgroups: Cgroups::system(),
            clock: Clock::system(),
            fs: Arc::new(HostFs),
            gpu_health: None,
        }
    }
}
