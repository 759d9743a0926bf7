//! Detection (IO): which vendor's device paths exist, and the vendor tool's list of GPUs.
//! Order and tool arguments are upstream's (runner/internal/common/gpu/gpu.go `GetGpuVendor`,
//! runner/internal/shim/host/gpu.go `GetGpuInfo`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::parse::{
    normalize_version, parse_amd_smi, parse_hl_smi, parse_nvidia_smi, parse_tt_smi,
};
use super::topo::{Topology, parse_nvidia_topo};
use super::{GpuInfo, GpuVendor, HostGpus};
use crate::error::{ResourcesError, Result};
use shim_util::{Command, CommandError, CommandOutput, CommandRunner, error_chain};

/// The image upstream runs `amd-smi` from.
pub const AMD_SMI_IMAGE: &str = "dstackai/amd-smi:latest";
/// The image upstream runs `tt-smi` from.
pub const TT_SMI_IMAGE: &str = "dstackai/tt-smi:latest";
/// Where WSL2 puts `nvidia-smi`; with `/dev/dxg` it means an NVIDIA GPU.
pub const WSL_NVIDIA_SMI: &str = "/usr/lib/wsl/lib/nvidia-smi";
/// How long one `amd-smi` run may take (upstream's `execAmdSmiStatic` timeout).
pub const AMD_SMI_TIMEOUT: Duration = Duration::from_secs(120);

/// The `nvidia-smi` arguments.
pub const NVIDIA_SMI_ARGS: [&str; 2] = [
    "--query-gpu=index,name,memory.total,uuid,driver_version",
    "--format=csv,noheader,nounits",
];
/// The `nvidia-smi` arguments of the interconnect matrix.
pub const NVIDIA_SMI_TOPO_ARGS: [&str; 2] = ["topo", "-m"];
/// The `hl-smi` arguments.
pub const HL_SMI_ARGS: [&str; 2] = [
    "--query-aip=name,memory.total,index",
    "--format=csv,noheader,nounits",
];

/// Detects the vendor and lists GPUs. The command runner and the `/dev`, `/sys` and WSL tool
/// paths are injectable (tests use a temporary tree and recorded outputs).
pub struct GpuDetector {
    dev_root: PathBuf,
    sys_root: PathBuf,
    wsl_nvidia_smi: PathBuf,
    runner: Arc<dyn CommandRunner>,
}

impl std::fmt::Debug for GpuDetector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDetector")
            .field("dev_root", &self.dev_root)
            .field("sys_root", &self.sys_root)
            .field("wsl_nvidia_smi", &self.wsl_nvidia_smi)
            .finish_non_exhaustive()
    }
}

impl GpuDetector {
    /// A detector looking at `/dev`, `/sys` and [`WSL_NVIDIA_SMI`], running tools with
    /// `runner`.
    pub fn new(runner: Arc<dyn CommandRunner>) -> Self {
        Self {
            dev_root: PathBuf::from("/dev"),
            sys_root: PathBuf::from("/sys"),
            wsl_nvidia_smi: PathBuf::from(WSL_NVIDIA_SMI),
            runner,
        }
    }

    /// Looks for device nodes under `dev_root` instead of `/dev`.
    pub fn with_dev_root(mut self, dev_root: impl Into<PathBuf>) -> Self {
        self.dev_root = dev_root.into();
        self
    }

    /// Reads driver files under `sys_root` instead of `/sys`.
    pub fn with_sys_root(mut self, sys_root: impl Into<PathBuf>) -> Self {
        self.sys_root = sys_root.into();
        self
    }

    /// Looks for WSL's `nvidia-smi` at `path` instead of [`WSL_NVIDIA_SMI`].
    pub fn with_wsl_nvidia_smi(mut self, path: impl Into<PathBuf>) -> Self {
        self.wsl_nvidia_smi = path.into();
        self
    }

    /// Upstream's `checkPath`: `stat` (following links) succeeds; an error other than "does
    /// not exist" is logged and counts as absent.
    fn exists(path: &Path) -> bool {
        match fs_err::metadata(path) {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e,
                    "cannot check a path while detecting accelerators");
                false
            }
        }
    }

    /// The vendor whose device paths exist, if any. Unambiguous paths first (NVIDIA,
    /// Tenstorrent), then `/dev/kfd` (AMD, iGPUs included) before the vendor-neutral
    /// `/dev/accel` (taken for Intel Gaudi), as upstream's `GetGpuVendor`.
    pub fn detect_vendor(&self) -> Option<GpuVendor> {
        let dev = |rel: &str| Self::exists(&self.dev_root.join(rel));
        if dev("nvidiactl") || (dev("dxg") && Self::exists(&self.wsl_nvidia_smi)) {
            Some(GpuVendor::Nvidia)
        } else if dev("tenstorrent") {
            Some(GpuVendor::Tenstorrent)
        } else if dev("kfd") {
            Some(GpuVendor::Amd)
        } else if dev("accel") {
            Some(GpuVendor::Intel)
        } else {
            None
        }
    }

    /// Detects the vendor and lists its GPUs. A failing tool is logged and yields no GPUs (the
    /// shim still starts; tasks asking for GPUs then fail with a clear error).
    pub async fn detect(&self) -> HostGpus {
        let Some(vendor) = self.detect_vendor() else {
            return HostGpus::none();
        };
        match self.list(vendor).await {
            Ok((gpus, driver_version)) => {
                tracing::info!(%vendor, count = gpus.len(), ?driver_version, "GPUs detected");
                HostGpus {
                    vendor: Some(vendor),
                    driver_version,
                    gpus,
                }
            }
            Err(e) => {
                tracing::error!(%vendor, error = %error_chain(&e), "cannot list GPUs");
                HostGpus {
                    vendor: Some(vendor),
                    driver_version: None,
                    gpus: Vec::new(),
                }
            }
        }
    }

    /// Runs `command`; a non-zero exit is an error.
    async fn run(&self, command: &Command) -> Result<CommandOutput> {
        Ok(self.runner.run(command).await?.check(command)?)
    }

    /// Lists `vendor`'s GPUs with its tool; returns them and the driver version.
    pub async fn list(&self, vendor: GpuVendor) -> Result<(Vec<GpuInfo>, Option<String>)> {
        match vendor {
            GpuVendor::Nvidia => {
                let command = Command::new("nvidia-smi").args(NVIDIA_SMI_ARGS);
                let out = self.runner.run(&command).await?;
                if out.success() {
                    return parse_nvidia_smi(&out.stdout);
                }
                // A GPU the driver cannot reach (fallen off the bus, needing a reset) is an
                // error line in its place and a failed exit, the others listed all the same:
                // those are the host's GPUs (each row names its own index), the lost one is
                // left out. Nothing listed: the failure is the answer.
                match parse_nvidia_smi(&out.stdout) {
                    Ok((gpus, driver)) if !gpus.is_empty() => {
                        tracing::warn!(error = %error_chain(&out.failure(&command)), count = gpus.len(),
                            "nvidia-smi failed for some GPUs; the GPUs it listed are used");
                        Ok((gpus, driver))
                    }
                    _ => Err(out.failure(&command).into()),
                }
            }
            GpuVendor::Amd => self.list_amd().await,
            GpuVendor::Tenstorrent => {
                let args = [
                    "run",
                    "--rm",
                    "--device",
                    "/dev/tenstorrent",
                    TT_SMI_IMAGE,
                    "-s",
                ];
                let out = self.run(&Command::new("docker").args(args)).await?;
                let gpus = parse_tt_smi(&out.stdout)?;
                let version_file = self.sys_root.join("module/tenstorrent/version");
                let driver = match fs_err::read_to_string(&version_file) {
                    Ok(v) => normalize_version(&v),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot read the Tenstorrent driver version");
                        None
                    }
                };
                Ok((gpus, driver))
            }
            GpuVendor::Intel => {
                let out = self.run(&Command::new("hl-smi").args(HL_SMI_ARGS)).await?;
                Ok((parse_hl_smi(&out.stdout)?, None))
            }
        }
    }

    /// Runs `nvidia-smi topo -m` and parses its matrix: the link between every two NVIDIA
    /// GPUs and the NUMA node each is near, for [`choose`](super::topo::choose). A tool that
    /// fails, or a matrix that cannot be read, is an error (the caller then places GPUs
    /// first-free).
    pub async fn topology(&self) -> Result<Topology> {
        let out = self
            .run(&Command::new("nvidia-smi").args(NVIDIA_SMI_TOPO_ARGS))
            .await?;
        parse_nvidia_topo(&out.stdout)
    }

    async fn list_amd(&self) -> Result<(Vec<GpuInfo>, Option<String>)> {
        let out = match self.amd_smi(true).await {
            // Only an amd-smi that ran and failed may lack --driver; retrying after a
            // timeout or a failure to start would only double the wait.
            Err(e @ ResourcesError::Command(CommandError::Failed { .. })) => {
                tracing::error!(error = %error_chain(&e), "amd-smi with --driver failed; retrying without");
                self.amd_smi(false).await?
            }
            other => other?,
        };
        let (raw, driver) = parse_amd_smi(&out)?;
        let mut gpus = Vec::with_capacity(raw.len());
        for g in raw {
            match self.render_node(&g.bdf) {
                Ok(node) => gpus.push(GpuInfo {
                    vendor: GpuVendor::Amd,
                    name: g.name,
                    memory_mib: g.memory_mib,
                    id: node,
                    index: u32::try_from(gpus.len()).unwrap_or(u32::MAX),
                }),
                Err(e) => {
                    tracing::error!(bdf = %g.bdf, error = %error_chain(&e), "no render node for AMD GPU");
                }
            }
        }
        Ok((gpus, driver))
    }

    /// `docker run --rm --device /dev/kfd --device /dev/dri dstackai/amd-smi:latest static
    /// --json --asic --vram --bus [--driver]`, killed after [`AMD_SMI_TIMEOUT`].
    async fn amd_smi(&self, with_driver: bool) -> Result<String> {
        let mut args = vec![
            "run",
            "--rm",
            "--device",
            "/dev/kfd",
            "--device",
            "/dev/dri",
            AMD_SMI_IMAGE,
            "static",
            "--json",
            "--asic",
            "--vram",
            "--bus",
        ];
        if with_driver {
            args.push("--driver");
        }
        let out = self
            .run(&Command::new("docker").args(args).timeout(AMD_SMI_TIMEOUT))
            .await?;
        Ok(out.stdout)
    }

    /// `<dev>/dri/by-path/pci-<bdf>-render` resolved to its target (`/dev/dri/renderD<N>`).
    fn render_node(&self, bdf: &str) -> Result<String> {
        if bdf.is_empty() || bdf.contains(['/', '\0']) {
            return Err(ResourcesError::Parse {
                tool: "amd-smi",
                why: format!("invalid bus address {bdf:?}"),
            });
        }
        let link = self.dev_root.join(format!("dri/by-path/pci-{bdf}-render"));
        let target =
            fs_err::canonicalize(&link).map_err(|e| ResourcesError::io("resolve", &link, e))?;
        Ok(target.to_string_lossy().into_owned())
    }
}
