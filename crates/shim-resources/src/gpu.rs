//! GPUs: vendor detection from device paths, listing with the vendor's tool, and the lock that
//! hands GPUs to tasks without ever over-allocating.
//!
//! Detection order (the first match wins): `<dev>/nvidiactl`, or WSL's `<dev>/dxg` with
//! `nvidia-smi` on the `PATH` → NVIDIA; `<dev>/tenstorrent` → Tenstorrent; `<dev>/kfd` → AMD;
//! `<dev>/accel` → Intel (Gaudi).
//!
//! A GPU's id is what the container configuration needs: the NVIDIA UUID, the AMD render node
//! path (`/dev/dri/renderD<N>`), the index otherwise (`/dev/tenstorrent/<index>`,
//! `HABANA_VISIBLE_DEVICES`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::cmd::CommandRunner;
use crate::error::{Error, Result};

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
    /// `GPU-00000000-0000-4000-8000-00000000000<i>`, for tests and `--test-fake-gpus`.
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

/// Detects the vendor and lists GPUs. Paths and the command runner are injectable.
pub struct GpuDetector {
    dev_root: PathBuf,
    sys_root: PathBuf,
    path_env: Option<std::ffi::OsString>,
    runner: Arc<dyn CommandRunner>,
}

impl std::fmt::Debug for GpuDetector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDetector")
            .field("dev_root", &self.dev_root)
            .field("sys_root", &self.sys_root)
            .finish_non_exhaustive()
    }
}

/// The image dstack's shim runs `amd-smi` from when it is not installed on the host.
pub const AMD_SMI_IMAGE: &str = "dstackai/amd-smi:latest";
/// The image dstack's shim runs `tt-smi` from when it is not installed on the host.
pub const TT_SMI_IMAGE: &str = "dstackai/tt-smi:latest";

impl GpuDetector {
    /// A detector looking at `/dev` and `/sys`, running tools with `runner`.
    pub fn new(runner: Arc<dyn CommandRunner>) -> Self {
        Self {
            dev_root: PathBuf::from("/dev"),
            sys_root: PathBuf::from("/sys"),
            path_env: std::env::var_os("PATH"),
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

    /// Looks for tools in `path` (a `PATH`-style list) instead of `$PATH`.
    pub fn with_path_env(mut self, path: impl Into<std::ffi::OsString>) -> Self {
        self.path_env = Some(path.into());
        self
    }

    fn dev(&self, rel: &str) -> PathBuf {
        self.dev_root.join(rel)
    }

    fn on_path(&self, program: &str) -> bool {
        self.path_env.as_ref().is_some_and(|p| {
            std::env::split_paths(p).any(|d| {
                let f = d.join(program);
                fs_err::metadata(&f).is_ok_and(|m| m.is_file())
            })
        })
    }

    /// The vendor whose device paths exist, if any.
    pub fn detect_vendor(&self) -> Option<GpuVendor> {
        let exists = |rel: &str| self.dev(rel).symlink_metadata().is_ok();
        if exists("nvidiactl") || (exists("dxg") && self.on_path("nvidia-smi")) {
            Some(GpuVendor::Nvidia)
        } else if exists("tenstorrent") {
            Some(GpuVendor::Tenstorrent)
        } else if exists("kfd") {
            Some(GpuVendor::Amd)
        } else if exists("accel") {
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
                tracing::error!(%vendor, error = %e, "cannot list GPUs");
                HostGpus {
                    vendor: Some(vendor),
                    driver_version: None,
                    gpus: Vec::new(),
                }
            }
        }
    }

    /// Lists `vendor`'s GPUs with its tool; returns them and the driver version.
    pub async fn list(&self, vendor: GpuVendor) -> Result<(Vec<GpuInfo>, Option<String>)> {
        match vendor {
            GpuVendor::Nvidia => {
                let args = [
                    "--query-gpu=name,memory.total,uuid,driver_version",
                    "--format=csv,noheader,nounits",
                ];
                let out = self.runner.run("nvidia-smi", &args).await?;
                let out = out.check("nvidia-smi", &args)?;
                parse_nvidia_smi(&out.stdout)
            }
            GpuVendor::Amd => {
                let out = self.amd_smi(true).await;
                let out = match out {
                    Err(Error::CommandFailed { .. }) => {
                        // Older amd-smi versions do not know --driver.
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
                            tracing::error!(bdf = %g.bdf, error = %e, "no render node for AMD GPU");
                        }
                    }
                }
                Ok((gpus, driver))
            }
            GpuVendor::Tenstorrent => {
                let out = if self.on_path("tt-smi") {
                    self.runner
                        .run("tt-smi", &["-s"])
                        .await?
                        .check("tt-smi", &["-s"])?
                } else {
                    let args = [
                        "run",
                        "--rm",
                        "--device",
                        "/dev/tenstorrent",
                        TT_SMI_IMAGE,
                        "-s",
                    ];
                    self.runner
                        .run("docker", &args)
                        .await?
                        .check("docker", &args)?
                };
                let (gpus, from_json) = parse_tt_smi(&out.stdout)?;
                let from_sys =
                    fs_err::read_to_string(self.sys_root.join("module/tenstorrent/version"))
                        .ok()
                        .and_then(|v| normalize_version(&v));
                Ok((gpus, from_sys.or(from_json)))
            }
            GpuVendor::Intel => {
                let args = [
                    "--query-aip=name,memory.total,index,driver_version",
                    "--format=csv,noheader,nounits",
                ];
                let out = self
                    .runner
                    .run("hl-smi", &args)
                    .await?
                    .check("hl-smi", &args)?;
                parse_hl_smi(&out.stdout)
            }
        }
    }

    async fn amd_smi(&self, with_driver: bool) -> Result<String> {
        let mut tool_args = vec!["static", "--json", "--asic", "--vram", "--bus"];
        if with_driver {
            tool_args.push("--driver");
        }
        let (program, args): (&str, Vec<&str>) = if self.on_path("amd-smi") {
            ("amd-smi", tool_args)
        } else {
            let mut a = vec![
                "run",
                "--rm",
                "--device",
                "/dev/kfd",
                "--device",
                "/dev/dri",
                AMD_SMI_IMAGE,
            ];
            a.extend(tool_args);
            ("docker", a)
        };
        Ok(self
            .runner
            .run(program, &args)
            .await?
            .check(program, &args)?
            .stdout)
    }

    /// `<dev>/dri/by-path/pci-<bdf>-render` resolved to its target (`/dev/dri/renderD<N>`).
    fn render_node(&self, bdf: &str) -> Result<String> {
        if bdf.is_empty() || bdf.contains(['/', '\0']) {
            return Err(Error::Parse {
                tool: "amd-smi",
                why: format!("invalid bus address {bdf:?}"),
            });
        }
        let link = self.dev(&format!("dri/by-path/pci-{bdf}-render"));
        let target = fs_err::canonicalize(&link).map_err(|e| Error::io("resolve", &link, e))?;
        Ok(target.to_string_lossy().into_owned())
    }
}

/// `N/A`, `[Not Supported]` and friends mean "unknown".
fn normalize_version(v: &str) -> Option<String> {
    let v = v.trim();
    let upper = v.to_ascii_uppercase();
    let placeholder = [
        "",
        "N/A",
        "[N/A]",
        "UNKNOWN",
        "[UNKNOWN]",
        "[NOT SUPPORTED]",
        "[NOT AVAILABLE]",
    ];
    (!placeholder.contains(&upper.as_str())).then(|| v.to_owned())
}

fn parse_u64_field(tool: &'static str, what: &str, v: &str) -> Result<u64> {
    let v = v.trim();
    // Some tools print floats for memory; keep the integer part.
    let int = v.split('.').next().unwrap_or(v);
    int.parse().map_err(|_| Error::Parse {
        tool,
        why: format!("{what} {v:?} is not a number"),
    })
}

fn csv_fields(line: &str) -> Vec<&str> {
    line.split(',').map(str::trim).collect()
}

/// Parses `nvidia-smi --query-gpu=name,memory.total,uuid,driver_version
/// --format=csv,noheader,nounits`.
pub fn parse_nvidia_smi(out: &str) -> Result<(Vec<GpuInfo>, Option<String>)> {
    let mut gpus = Vec::new();
    let mut driver = None;
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f = csv_fields(line);
        let [name, mem, uuid, version] = f.as_slice() else {
            return Err(Error::Parse {
                tool: "nvidia-smi",
                why: format!("expected 4 fields, got {}: {line:?}", f.len()),
            });
        };
        if uuid.is_empty() {
            return Err(Error::Parse {
                tool: "nvidia-smi",
                why: format!("empty uuid: {line:?}"),
            });
        }
        let memory_mib = parse_u64_field("nvidia-smi", "memory.total", mem).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "unknown GPU memory");
            0
        });
        driver = driver.or_else(|| normalize_version(version));
        gpus.push(GpuInfo {
            vendor: GpuVendor::Nvidia,
            name: (*name).to_owned(),
            memory_mib,
            id: (*uuid).to_owned(),
            index: u32::try_from(gpus.len()).unwrap_or(u32::MAX),
        });
    }
    Ok((gpus, driver))
}

/// Parses `hl-smi --query-aip=name,memory.total,index[,driver_version]
/// --format=csv,noheader,nounits`.
pub fn parse_hl_smi(out: &str) -> Result<(Vec<GpuInfo>, Option<String>)> {
    let mut gpus = Vec::new();
    let mut driver = None;
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f = csv_fields(line);
        let (name, mem, index, version) = match f.as_slice() {
            [n, m, i] => (n, m, i, None),
            [n, m, i, v] => (n, m, i, Some(v)),
            _ => {
                return Err(Error::Parse {
                    tool: "hl-smi",
                    why: format!("expected 3 or 4 fields, got {}: {line:?}", f.len()),
                });
            }
        };
        let index_n: u32 = index.parse().map_err(|_| Error::Parse {
            tool: "hl-smi",
            why: format!("index {index:?} is not a number"),
        })?;
        let memory_mib = parse_u64_field("hl-smi", "memory.total", mem).unwrap_or(0);
        driver = driver.or_else(|| version.and_then(|v| normalize_version(v)));
        gpus.push(GpuInfo {
            vendor: GpuVendor::Intel,
            name: (*name).to_owned(),
            memory_mib,
            id: index_n.to_string(),
            index: index_n,
        });
    }
    Ok((gpus, driver))
}

/// One GPU as `amd-smi static --json` describes it, before its render node is resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmdGpu {
    /// `asic.market_name`.
    pub name: String,
    /// `vram.size.value` (MiB).
    pub memory_mib: u64,
    /// `bus.bdf`, e.g. `0000:5f:00.0`.
    pub bdf: String,
}

/// Parses `amd-smi static --json --asic --vram --bus [--driver]`: a list (ROCm 6.x) or
/// `{"gpu_data": [...]}` (ROCm 7.x). Returns the GPUs and the driver version.
pub fn parse_amd_smi(out: &str) -> Result<(Vec<AmdGpu>, Option<String>)> {
    let v: serde_json::Value = serde_json::from_str(out).map_err(|e| Error::Parse {
        tool: "amd-smi",
        why: e.to_string(),
    })?;
    let list = match &v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => match o.get("gpu_data") {
            Some(serde_json::Value::Array(a)) => a,
            _ => {
                return Err(Error::Parse {
                    tool: "amd-smi",
                    why: "neither a list nor an object with gpu_data".to_owned(),
                });
            }
        },
        _ => {
            return Err(Error::Parse {
                tool: "amd-smi",
                why: "neither a list nor an object with gpu_data".to_owned(),
            });
        }
    };
    let mut gpus = Vec::new();
    let mut driver = None;
    for g in list {
        let s = |ptr: &str| g.pointer(ptr).and_then(|x| x.as_str()).map(str::to_owned);
        let memory_mib = g
            .pointer("/vram/size/value")
            .and_then(|x| {
                x.as_u64()
                    .or_else(|| x.as_str().and_then(|s| s.trim().parse().ok()))
            })
            .unwrap_or(0);
        // The driver section's keys differ between versions; an unknown shape is "unknown".
        let version = g.get("driver").and_then(|d| {
            d.as_object().and_then(|o| {
                o.iter()
                    .find(|(k, _)| {
                        k.eq_ignore_ascii_case("version")
                            || k.eq_ignore_ascii_case("driver_version")
                    })
                    .and_then(|(_, v)| v.as_str())
                    .and_then(normalize_version)
            })
        });
        driver = driver.or(version);
        gpus.push(AmdGpu {
            name: s("/asic/market_name").unwrap_or_default(),
            memory_mib,
            bdf: s("/bus/bdf").unwrap_or_default(),
        });
    }
    Ok((gpus, driver))
}

#[derive(Debug, Deserialize)]
struct TtSnapshot {
    #[serde(default)]
    host_info: Option<serde_json::Map<String, serde_json::Value>>,
    device_info: Vec<TtDevice>,
}

#[derive(Debug, Deserialize)]
struct TtDevice {
    board_info: TtBoard,
}

#[derive(Debug, Deserialize)]
struct TtBoard {
    #[serde(default)]
    board_type: String,
    #[serde(default)]
    board_id: String,
    #[serde(default)]
    bus_id: String,
}

fn tt_board_name(board_type: &str) -> (String, Option<char>) {
    let t = board_type.trim();
    let (base, side) = match t.rsplit_once(' ') {
        Some((b, "L")) => (b.trim(), Some('L')),
        Some((b, "R")) => (b.trim(), Some('R')),
        _ => (t, None),
    };
    let name = if base == "bh-scrappy" || base == "p100" {
        "p100a"
    } else if base.starts_with("p150") {
        "p150"
    } else if base.starts_with("p300") {
        "p300"
    } else {
        base
    };
    (name.to_owned(), side)
}

fn tt_memory_mib(name: &str) -> u64 {
    if name.starts_with("n150") || name.starts_with("n300") || name.starts_with("tt-galaxy-wh") {
        12 * 1024
    } else if name == "p100a" {
        28 * 1024
    } else if matches!(name, "p150" | "p300" | "tt-galaxy-bh") {
        32 * 1024
    } else {
        0
    }
}

/// Parses `tt-smi -s` JSON. Every locally attached chip (`L` side, or a board without a side
/// that is attached over PCIe) is a GPU; remote chips (`R` side, or no PCIe bus) add their
/// memory to the GPU of the same board. Returns the GPUs and the driver version from
/// `host_info.Driver` (`TT-KMD 1.34` → `1.34`).
pub fn parse_tt_smi(out: &str) -> Result<(Vec<GpuInfo>, Option<String>)> {
    let snap: TtSnapshot = serde_json::from_str(out).map_err(|e| Error::Parse {
        tool: "tt-smi",
        why: e.to_string(),
    })?;
    let mut gpus: Vec<(String, GpuInfo)> = Vec::new(); // (board id, gpu)
    let mut remote: Vec<(String, String)> = Vec::new(); // (board id, name)
    for d in &snap.device_info {
        let b = &d.board_info;
        let (name, side) = tt_board_name(&b.board_type);
        let is_remote = side == Some('R') || b.bus_id.trim().eq_ignore_ascii_case("N/A");
        if is_remote {
            remote.push((b.board_id.clone(), name));
            continue;
        }
        let index = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
        gpus.push((
            b.board_id.clone(),
            GpuInfo {
                vendor: GpuVendor::Tenstorrent,
                memory_mib: tt_memory_mib(&name),
                name,
                id: index.to_string(),
                index,
            },
        ));
    }
    for (board, name) in remote {
        if let Some((_, g)) = gpus.iter_mut().find(|(b, g)| *b == board && g.name == name) {
            g.memory_mib += tt_memory_mib(&name);
        } else if let Some((_, g)) = gpus.iter_mut().find(|(b, _)| *b == board) {
            g.memory_mib += tt_memory_mib(&name);
        } else {
            tracing::warn!(board, "remote Tenstorrent chip without a local board");
        }
    }
    let driver = snap
        .host_info
        .as_ref()
        .and_then(|h| h.get("Driver"))
        .and_then(|d| d.as_str())
        .map(|d| d.trim().trim_start_matches("TT-KMD").trim().to_owned())
        .and_then(|d| normalize_version(&d));
    Ok((gpus.into_iter().map(|(_, g)| g).collect(), driver))
}

/// Hands GPUs to tasks. Locking never over-allocates: a request that cannot be met in full
/// locks nothing. Safe to share (`Arc<GpuLock>`).
#[derive(Debug)]
pub struct GpuLock {
    ids: Vec<String>,
    locked: Mutex<BTreeSet<String>>,
}

impl GpuLock {
    /// A lock over the GPUs with these ids (in allocation order).
    pub fn new(ids: impl IntoIterator<Item = String>) -> Self {
        let mut seen = BTreeSet::new();
        let ids = ids.into_iter().filter(|i| seen.insert(i.clone())).collect();
        Self {
            ids,
            locked: Mutex::new(BTreeSet::new()),
        }
    }

    /// A lock over the host's GPUs.
    pub fn for_host(gpus: &HostGpus) -> Self {
        Self::new(gpus.ids())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.locked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks `n` free GPUs: `-1` all free ones (possibly none), `0` none. Returns the locked
    /// ids; [`Error::NotEnoughGpus`] with nothing locked when fewer than `n` are free.
    pub fn acquire(&self, n: i64) -> Result<Vec<String>> {
        if n < -1 {
            return Err(Error::InvalidGpuCount { requested: n });
        }
        let mut locked = self.state();
        let free: Vec<&String> = self.ids.iter().filter(|i| !locked.contains(*i)).collect();
        let take = if n == -1 {
            free.len()
        } else {
            match usize::try_from(n) {
                Ok(k) if k <= free.len() => k,
                _ => {
                    return Err(Error::NotEnoughGpus {
                        requested: n,
                        free: free.len(),
                        total: self.ids.len(),
                    });
                }
            }
        };
        let chosen: Vec<String> = free.into_iter().take(take).cloned().collect();
        locked.extend(chosen.iter().cloned());
        Ok(chosen)
    }

    /// Locks the given ids (a restored task's GPUs). Returns only those newly locked: ids
    /// already locked or unknown to the host are left out (unknown ones are logged).
    pub fn lock(&self, ids: &[String]) -> Vec<String> {
        let mut locked = self.state();
        let mut newly = Vec::new();
        for id in ids {
            if !self.ids.contains(id) {
                tracing::warn!(gpu = %id, "cannot lock a GPU the host does not have");
                continue;
            }
            if locked.insert(id.clone()) {
                newly.push(id.clone());
            }
        }
        newly
    }

    /// Unlocks the given ids; unknown or already free ids are ignored (idempotent).
    pub fn release(&self, ids: &[String]) {
        let mut locked = self.state();
        for id in ids {
            locked.remove(id);
        }
    }

    /// The ids currently locked, sorted.
    pub fn locked(&self) -> Vec<String> {
        self.state().iter().cloned().collect()
    }

    /// How many GPUs are free.
    pub fn free_count(&self) -> usize {
        let locked = self.state();
        self.ids.iter().filter(|i| !locked.contains(*i)).count()
    }

    /// How many GPUs the lock manages.
    pub fn total(&self) -> usize {
        self.ids.len()
    }
}

/// Whether `path` looks like an AMD render node path (`/dev/dri/renderD<N>`).
pub fn is_render_node(path: &Path) -> bool {
    path.to_str()
        .is_some_and(|p| p.starts_with("/dev/dri/renderD"))
}
