//! Per-vendor parsing of the GPU tools' output (pure). Each follows the matching function of
//! upstream's runner/internal/shim/host/gpu.go; where we differ it is said.

use serde::Deserialize;

use super::{GpuInfo, GpuVendor};
use crate::error::{ResourcesError, Result};

/// `N/A`, `[Not Supported]` and friends mean "unknown" (upstream's `normalizeDriverVersion`).
pub(crate) fn normalize_version(v: &str) -> Option<String> {
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
    v.parse().map_err(|_| ResourcesError::Parse {
        tool,
        why: format!("{what} {v:?} is not a number"),
    })
}

fn csv_fields(line: &str) -> Vec<&str> {
    line.split(',').map(str::trim).collect()
}

// ---------------------------------------------------------------------------------- NVIDIA

/// Parses `nvidia-smi --query-gpu=index,name,memory.total,uuid,driver_version
/// --format=csv,noheader,nounits` (upstream's `getNvidiaGpuInfo`, which asks for the last four
/// and numbers the GPUs by their position): five fields a line; memory that is not a number is
/// 0. Each GPU keeps the index `nvidia-smi` gives it (CDI's index names and the topology use
/// it), so a line that is not a GPU's (an error `nvidia-smi` prints in place of a GPU it cannot
/// reach) is skipped, logged, and shifts no other GPU; output with lines but no GPU line is an
/// error.
pub fn parse_nvidia_smi(out: &str) -> Result<(Vec<GpuInfo>, Option<String>)> {
    let mut gpus = Vec::new();
    let mut driver = None;
    let mut skipped = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f = csv_fields(line);
        let [index, name, mem, uuid, version] = f.as_slice() else {
            skipped.push(format!("expected 5 fields, got {}: {line:?}", f.len()));
            continue;
        };
        let Ok(index) = index.parse::<u32>() else {
            skipped.push(format!("index {index:?} is not a number: {line:?}"));
            continue;
        };
        if uuid.is_empty() {
            skipped.push(format!("empty uuid: {line:?}"));
            continue;
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
            index,
        });
    }
    if gpus.is_empty() && !skipped.is_empty() {
        return Err(ResourcesError::Parse {
            tool: "nvidia-smi",
            why: skipped.join("; "),
        });
    }
    for why in skipped {
        tracing::warn!(%why, "nvidia-smi: a line that lists no GPU was skipped");
    }
    Ok((gpus, driver))
}

// ------------------------------------------------------------------------------ Intel Gaudi

/// Parses `hl-smi --query-aip=name,memory.total,index --format=csv,noheader,nounits`
/// (upstream's `getIntelGpuInfo`): three fields a line; the id is the index as printed.
/// `hl-smi` is not asked for a driver version (upstream does not ask either).
pub fn parse_hl_smi(out: &str) -> Result<Vec<GpuInfo>> {
    let mut gpus = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f = csv_fields(line);
        let [name, mem, index] = f.as_slice() else {
            return Err(ResourcesError::Parse {
                tool: "hl-smi",
                why: format!("expected 3 fields, got {}: {line:?}", f.len()),
            });
        };
        let index_n: u32 = index.parse().map_err(|_| ResourcesError::Parse {
            tool: "hl-smi",
            why: format!("index {index:?} is not a number"),
        })?;
        let memory_mib = parse_u64_field("hl-smi", "memory.total", mem).unwrap_or(0);
        gpus.push(GpuInfo {
            vendor: GpuVendor::Intel,
            name: (*name).to_owned(),
            memory_mib,
            id: (*index).to_owned(),
            index: index_n,
        });
    }
    Ok(gpus)
}

// -------------------------------------------------------------------------------------- AMD

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

/// The driver version of an `amd-smi` `driver` section (upstream's `amdDriver`): key names
/// are matched without regard to case, `version` is preferred over `driver_version`, a
/// placeholder counts as missing, and any other shape is "unknown".
fn amd_driver_version(section: Option<&serde_json::Value>) -> Option<String> {
    let obj = section?.as_object()?;
    let get = |key: &str| {
        obj.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .and_then(|(_, v)| v.as_str())
            .and_then(normalize_version)
    };
    get("version").or_else(|| get("driver_version"))
}

/// Parses `amd-smi static --json --asic --vram --bus [--driver]`: a list (ROCm 6.x) or
/// `{"gpu_data": [...]}` (ROCm 7.x), as upstream's `parseAmdSmiOutput`. Returns the GPUs and
/// the driver version.
pub fn parse_amd_smi(out: &str) -> Result<(Vec<AmdGpu>, Option<String>)> {
    let v: serde_json::Value = serde_json::from_str(out).map_err(|e| ResourcesError::Parse {
        tool: "amd-smi",
        why: e.to_string(),
    })?;
    let list = match &v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => match o.get("gpu_data") {
            Some(serde_json::Value::Array(a)) => a,
            _ => {
                return Err(ResourcesError::Parse {
                    tool: "amd-smi",
                    why: "neither a list nor an object with gpu_data".to_owned(),
                });
            }
        },
        _ => {
            return Err(ResourcesError::Parse {
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
        driver = driver.or_else(|| amd_driver_version(g.get("driver")));
        gpus.push(AmdGpu {
            name: s("/asic/market_name").unwrap_or_default(),
            memory_mib,
            bdf: s("/bus/bdf").unwrap_or_default(),
        });
    }
    Ok((gpus, driver))
}

// ------------------------------------------------------------------------------ Tenstorrent

#[derive(Debug, Default, Deserialize)]
struct TtSnapshot {
    #[serde(default)]
    device_info: Option<Vec<TtDevice>>,
}

#[derive(Debug, Default, Deserialize)]
struct TtDevice {
    #[serde(default)]
    board_info: Option<TtBoard>,
}

#[derive(Debug, Default, Clone, Deserialize)]
struct TtBoard {
    #[serde(default)]
    board_type: Option<String>,
    #[serde(default)]
    board_id: Option<String>,
    #[serde(default)]
    bus_id: Option<String>,
}

/// Upstream's `normalizeTtBoardName`.
fn tt_normalize_name(name: &str) -> String {
    if name == "bh-scrappy" || name == "p100" {
        "p100a".to_owned()
    } else if name.starts_with("p150") {
        "p150".to_owned()
    } else if name.starts_with("p300") {
        "p300".to_owned()
    } else {
        name.to_owned()
    }
}

/// Upstream's `splitTtBoardType`: `"n300 L"` → (`n300`, `L`).
fn tt_split_board_type(board_type: &str) -> (String, Option<char>) {
    let t = board_type.trim();
    let (base, side) = if let Some(b) = t.strip_suffix(" L") {
        (b.trim(), Some('L'))
    } else if let Some(b) = t.strip_suffix(" R") {
        (b.trim(), Some('R'))
    } else {
        (t, None)
    };
    (tt_normalize_name(base), side)
}

/// Upstream's `ttBoardVramMib`.
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

/// Upstream's `isTtBlackholeBoard`.
fn tt_is_blackhole(name: &str) -> bool {
    matches!(name, "p100a" | "p150" | "p300" | "tt-galaxy-bh")
}

struct TtGpu {
    board_id: String,
    name: String,
    memory_mib: u64,
}

/// Parses `tt-smi -s` JSON into GPUs exactly as upstream's `getGpusFromTtSmiSnapshot`:
///
/// 1. every `L` chip is a GPU;
/// 2. every `R` chip adds its memory to the first GPU of the same board (of the same name, for
///    Blackhole);
/// 3. a chip without a side: Blackhole → a GPU of its own unless remote (bus `N/A`);
///    otherwise its memory joins the first GPU of the same board, or it is a new GPU;
/// 4. a remote Blackhole chip without a side adds its memory to the GPU of the same board and
///    name.
///
/// GPUs are indexed 0.. in that order, and the index is their id (`/dev/tenstorrent/<id>`).
/// A missing `device_info` is no GPU; the driver version is not taken from here (upstream
/// reads `/sys/module/tenstorrent/version`).
pub fn parse_tt_smi(out: &str) -> Result<Vec<GpuInfo>> {
    let snap: TtSnapshot = serde_json::from_str(out).map_err(|e| ResourcesError::Parse {
        tool: "tt-smi",
        why: e.to_string(),
    })?;
    let devices: Vec<(TtBoard, String, Option<char>)> = snap
        .device_info
        .unwrap_or_default()
        .into_iter()
        .map(|d| {
            let b = d.board_info.unwrap_or_default();
            let (name, side) = tt_split_board_type(b.board_type.as_deref().unwrap_or_default());
            (b, name, side)
        })
        .collect();
    let board = |b: &TtBoard| b.board_id.clone().unwrap_or_default();
    let remote = |b: &TtBoard| {
        b.bus_id
            .as_deref()
            .unwrap_or_default()
            .trim()
            .eq_ignore_ascii_case("N/A")
    };
    let mut gpus: Vec<TtGpu> = Vec::new();
    let new_gpu = |b: &TtBoard, name: &str| TtGpu {
        board_id: board(b),
        name: name.to_owned(),
        memory_mib: tt_memory_mib(name),
    };
    for (b, name, side) in &devices {
        if *side == Some('L') {
            gpus.push(new_gpu(b, name));
        }
    }
    for (b, name, side) in &devices {
        if *side == Some('R') {
            let id = board(b);
            if let Some(g) = gpus
                .iter_mut()
                .find(|g| g.board_id == id && (g.name == *name || !tt_is_blackhole(name)))
            {
                g.memory_mib += tt_memory_mib(name);
            }
        }
    }
    for (b, name, side) in &devices {
        if side.is_some() {
            continue;
        }
        if tt_is_blackhole(name) {
            if !remote(b) {
                gpus.push(new_gpu(b, name));
            }
            continue;
        }
        let id = board(b);
        match gpus.iter_mut().find(|g| g.board_id == id) {
            Some(g) => g.memory_mib += tt_memory_mib(name),
            None => gpus.push(new_gpu(b, name)),
        }
    }
    for (b, name, side) in &devices {
        if side.is_some() || !tt_is_blackhole(name) || !remote(b) {
            continue;
        }
        let id = board(b);
        if let Some(g) = gpus
            .iter_mut()
            .find(|g| g.board_id == id && g.name == *name)
        {
            g.memory_mib += tt_memory_mib(name);
        }
    }
    Ok(gpus
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            GpuInfo {
                vendor: GpuVendor::Tenstorrent,
                name: g.name,
                memory_mib: g.memory_mib,
                id: index.to_string(),
                index,
            }
        })
        .collect())
}
