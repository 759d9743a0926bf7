//! GPUs: vendor detection from device paths, listing with the vendor's tool, and the lock that
//! hands GPUs to tasks without ever over-allocating. Three parts:
//!
//! - [`detect`] (IO): which device paths exist, running the vendor tool through the injected
//!   [`CommandRunner`](shim_util::CommandRunner), resolving AMD render nodes, reading the Tenstorrent driver
//!   version. The same order and tool arguments as dstack's Go shim
//!   (runner/internal/common/gpu/gpu.go, runner/internal/shim/host/gpu.go):
//!   `<dev>/nvidiactl`, or WSL's `<dev>/dxg` with `/usr/lib/wsl/lib/nvidia-smi` → NVIDIA;
//!   `<dev>/tenstorrent` → Tenstorrent; `<dev>/kfd` → AMD; `<dev>/accel` → Intel (Gaudi).
//!   AMD and Tenstorrent GPUs are listed, as upstream does, by running the vendor's image
//!   with the `docker` CLI (`docker run --rm --device … dstackai/amd-smi:latest static …`,
//!   `… dstackai/tt-smi:latest -s`); this is the crate's only use of Docker, and it goes
//!   through the command runner like every other tool.
//! - [`parse`] (pure, per vendor): `nvidia-smi` CSV, `amd-smi` JSON, `tt-smi` JSON, `hl-smi`
//!   CSV.
//! - [`lock`] (pure, in memory): [`GpuLock`].
//! - [`cdi`] (file IO): the host's CDI specs ([`CdiRegistry`]) and the CDI name of each GPU.
//! - [`topo`] (pure): the interconnect matrix of `nvidia-smi topo -m` as a [`Topology`]
//!   ([`GpuDetector::topology`] runs the tool), and [`choose`], which picks the free GPUs of
//!   a request on one NUMA node where it can and over the best links (see its module docs
//!   for the rule).
//! - [`health`] (NVIDIA): which GPUs must not take new tasks and why, from `nvidia-smi -q`
//!   (pending page retirement, pending or failed row remapping) and the driver's XIDs in the
//!   kernel log ([`probe_nvidia_health`], [`GpuHealthReport`], [`UnhealthyReason`]).
//!
//! A GPU's id is what the container configuration needs and what the lock hands out: the
//! NVIDIA UUID, the AMD render node path (`/dev/dri/renderD<N>`), the index otherwise
//! (`/dev/tenstorrent/<index>`, `HABANA_VISIBLE_DEVICES`), as upstream's `GpuLock`.
//!
//! Test seams: [`GpuDetector`] takes its command runner and its `/dev`, `/sys` and WSL tool
//! paths, so detection runs against a temporary device tree and recorded tool outputs; the
//! engine takes the detected [`HostGpus`] as data ([`HostGpus::fake_nvidia`] in tests) and a
//! real [`GpuLock`], which needs no fake.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub mod cdi;
pub mod detect;
pub mod health;
pub mod lock;
pub mod parse;
pub mod topo;

pub use cdi::{AMD_KIND, CdiDevice, CdiRegistry, NVIDIA_KIND};
pub use detect::{AMD_SMI_IMAGE, GpuDetector, TT_SMI_IMAGE, WSL_NVIDIA_SMI};
pub use health::{
    GpuHealth, GpuHealthReport, GpuHealthSource, GpuRef, HealthSource, KernelLog, Kmsg,
    NvidiaHealth, UnhealthyReason, XidMonitor, XidPolicy, probe_nvidia_health,
};
pub use lock::GpuLock;
pub use parse::{AmdGpu, parse_amd_smi, parse_hl_smi, parse_nvidia_smi, parse_tt_smi};
pub use topo::{Link, SetScore, Topology, choose, parse_nvidia_topo};

/// A GPU vendor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuVendor {
    /// NVIDIA (`nvidia-smi`).
    Nvidia,
    /// AMD (`amd-smi`).
    Amd,
    /// Intel Gaudi (`hl-smi`).
    Intel,
    /// Tenstorrent (`tt-smi`).
    Tenstorrent,
}

impl GpuVendor {
    /// The vendor's name on the wire: `nvidia`, `amd`, `intel`, `tenstorrent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nvidia => "nvidia",
            Self::Amd => "amd",
            Self::Intel => "intel",
            Self::Tenstorrent => "tenstorrent",
        }
    }
}

impl std::fmt::Display for GpuVendor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One GPU of the host.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Its vendor.
    pub vendor: GpuVendor,
    /// Its model name, e.g. `NVIDIA A100-SXM4-80GB`.
    pub name: String,
    /// Its memory in MiB (0 when unknown).
    pub memory_mib: u64,
    /// The id tasks lock it by: NVIDIA UUID, AMD render node path, index otherwise.
    pub id: String,
    /// Its position in the vendor tool's list (0-based).
    pub index: u32,
}

/// What the host has: the vendor (if any device path matched), the driver version (when the
/// tool reported one) and the GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostGpus {
    /// The detected vendor; `None` on a host without accelerators.
    pub vendor: Option<GpuVendor>,
    /// The host driver's version, e.g. `570.86.15`.
    pub driver_version: Option<String>,
    /// The GPUs, in the tool's order.
    pub gpus: Vec<GpuInfo>,
}

impl HostGpus {
    /// A host without GPUs.
    pub fn none() -> Self {
        Self::default()
    }

    /// A fake NVIDIA host with `n` GPUs (`n == 0` gives a host without GPUs) with UUIDs
    /// `GPU-00000000-0000-4000-8000-00000000000<i>`, for tests and `--fake-gpus`.
    pub fn fake_nvidia(n: u32) -> Self {
        if n == 0 {
            return Self::none();
        }
        Self {
            vendor: Some(GpuVendor::Nvidia),
            driver_version: Some("0.0.0-fake".to_owned()),
            gpus: (0..n)
                .map(|i| GpuInfo {
                    vendor: GpuVendor::Nvidia,
                    name: "Fake GPU".to_owned(),
                    memory_mib: 16 * 1024,
                    id: format!("GPU-00000000-0000-4000-8000-{i:012x}"),
                    index: i,
                })
                .collect(),
        }
    }

    /// The GPU ids, in order.
    pub fn ids(&self) -> Vec<String> {
        self.gpus.iter().map(|g| g.id.clone()).collect()
    }
}

/// Whether `path` looks like an AMD render node path (`/dev/dri/renderD<N>`), upstream's
/// `IsRenderNodePath`.
pub fn is_render_node(path: &Path) -> bool {
    path.to_str()
        .is_some_and(|p| p.starts_with("/dev/dri/renderD"))
}
