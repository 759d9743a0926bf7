//! NVIDIA GPU health: which GPUs must not be handed to new tasks, and why.
//!
//! Two sources, each behind a seam so tests run on fixture text:
//!
//! - `nvidia-smi -q`, run through the injected [`CommandRunner`]: per GPU its UUID, its PCI bus
//!   id and the memory-error state the driver keeps. [`parse_nvidia_smi_query`] (pure) reads
//!   it: `Retired Pages` / `Pending Page Blacklist: Yes` (pre-Ampere: pages waiting to be
//!   retired), `Remapped Rows` / `Pending: Yes` (Ampere and newer: a row waiting to be
//!   remapped) and `Remapped Rows` / `Remapping Failure Occurred: Yes`. `N/A` (a GPU without
//!   the feature, or a driver that cannot tell) is no reason.
//! - XIDs, the driver's error reports in the kernel log (`NVRM: Xid (PCI:0000:3b:00): 79, pid=…,
//!   GPU has fallen off the bus.`), read from a [`KernelLog`] ([`Kmsg`]: `/dev/kmsg` or any file
//!   of kernel log lines) by an [`XidMonitor`]. Its pure core, [`XidTracker`], keeps a cursor
//!   (a record counts once however often it is read), maps the PCI address to the GPU's UUID
//!   with the bus ids `nvidia-smi` printed, and keeps the XIDs that count.
//!
//! [`probe_nvidia_health`] runs both and returns a [`GpuHealthReport`]: every GPU with the
//! reasons (none when healthy) it must not take new tasks, and what could not be read. Acting on
//! it (keeping unhealthy GPUs from new tasks, leaving running tasks alone, reporting them) is
//! the caller's. DCGM's incidents (crate `shim-dcgm`) join the same report through
//! [`UnhealthyReason::dcgm`] and [`GpuHealthReport::add_reason`].
//!
//! # Which XIDs count
//!
//! NVIDIA's Kubernetes device plugin's rule: every XID makes its GPU unhealthy except the
//! application errors it skips by default, [`DEFAULT_SKIPPED_XIDS`] = 13 (graphics engine
//! exception), 31 (GPU memory page fault), 43 (GPU stopped processing), 45 (preemptive cleanup,
//! due to previous errors), 68 (video processor exception) and 109 (context switch timeout).
//! Source: NVIDIA/k8s-device-plugin, `internal/rm/health.go` at commit
//! 1b826acc6af3079d8923bac395c3124b8861a9a6, `getDisabledHealthCheckXids` (`ignoredXids`,
//! "Application errors: the GPU should still be healthy"). The operator adds to the skipped
//! XIDs as the plugin's `DP_DISABLE_HEALTHCHECKS` does (a comma-separated list added to the
//! defaults; `all` or `xids` turns XID checks off): [`XidPolicy::parse_skip_list`],
//! [`XidPolicy::skipping`].
//!
//! # How long an XID counts
//!
//! The plugin marks a device unhealthy for the rest of its life: `internal/plugin/server.go`
//! (same commit) says "FIXME: there is no way to recover from the Unhealthy state", so only a
//! restart of the plugin, which forgets everything, brings a GPU back. Here an XID counts
//! until the first of:
//!
//! - the NVIDIA kernel module is loaded again (a later `NVRM: loading NVIDIA UNIX …` record),
//!   which re-initialises every GPU;
//! - an operator clears it ([`XidMonitor::clear`], [`XidMonitor::clear_all`]);
//! - the host reboots (the kernel log starts afresh).
//!
//! A GPU reset without a module reload (`nvidia-smi -r`) leaves no record this module knows:
//! after one, the operator clears the GPU's XIDs.
//!
//! Unlike the plugin, records already in the kernel's buffer when the monitor starts count
//! (back to the last module load), so restarting the shim does not return a GPU to service:
//! only a driver reload, a reboot or an operator does. Two limits follow. The kernel's buffer is
//! a ring: an XID old enough to have been overwritten is forgotten at the next shim start. And
//! an operator's clear lasts until the shim restarts, which reads the record again. Time alone
//! never clears an XID: a quiet GPU is not a repaired one.
//!
//! # Pending row remapping counts
//!
//! `Remapped Rows` / `Pending: Yes` makes a GPU unhealthy until it is reset, which clears it
//! (the next probe puts the GPU back). Why:
//!
//! - "The process of row-remapping requires a GPU reset to take effect"
//!   (<https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/row-remapping.html>);
//! - DCGM's error table gives `DCGM_FR_PENDING_ROW_REMAP` the recovery action
//!   `DCGM_ERROR_RESET` (NVIDIA/DCGM `dcgmlib/src/dcgm_errors.c` at commit
//!   72fa3feaa67d716a75323a8f47c34ff3ee73f824);
//! - the device plugin's rule already marks the GPU unhealthy, for good, on the XID 63 logged
//!   with it ("Row Remapper: New row marked for remapping, reset gpu to activate."); the
//!   `nvidia-smi` state says the same in a form that survives a shim restart and clears itself
//!   at the reset;
//! - Ampere GA10x and Ada GPUs remap rows but have neither error containment nor dynamic page
//!   offlining (table 1 of NVIDIA's GPU memory error management document), so on them the bad
//!   row stays in use until the reset.
//!
//! The other view, which a caller may prefer: NVIDIA says that on A100 and H100 "even with the
//! [row-remapping pending] flag set, unaffected applications can continue running without
//! affecting accuracy and performance, and new workloads can be launched"
//! (<https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/error-recovery-and-response-flags.html>),
//! NVML's `nvmlDeviceGetRemappedRows` that "a pending remapping won't affect future work on the
//! GPU since error-containment and dynamic page blacklisting will take care of that", and
//! DCGM's passive health watches do not flag it (they flag a remapping failure, and pending page
//! retirement as a warning). A caller keeping such GPUs in service ignores
//! [`UnhealthyReason::RowRemapPending`] and skips XID 63 ([`XidPolicy::skipping`]).

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use shim_util::{Command, CommandRunner, error_chain};

use crate::blocking::blocking;
use crate::error::{ResourcesError, Result, io_err};

/// The XIDs skipped by default: the application errors NVIDIA's Kubernetes device plugin
/// ignores (`internal/rm/health.go`, `ignoredXids`): 13 graphics engine exception, 31 GPU
/// memory page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor
/// exception, 109 context switch timeout.
pub const DEFAULT_SKIPPED_XIDS: [u32; 6] = [13, 31, 43, 45, 68, 109];

/// The kernel log device.
pub const KMSG: &str = "/dev/kmsg";

/// What the NVIDIA kernel module logs when it loads (every GPU is initialised afresh).
const DRIVER_LOADED: &str = "NVRM: loading NVIDIA UNIX";

/// The read buffer for `/dev/kmsg`, which returns one record a read and fails with `EINVAL`
/// when the record does not fit: twice the kernel's largest formatted record
/// (`CONSOLE_EXT_LOG_MAX`, 8 KiB).
const KMSG_READ_BUFFER: usize = 16 * 1024;

// ------------------------------------------------------------------------------------ types

/// Why a GPU must not be handed to new tasks. On the wire (serde) an object tagged by
/// `kind`: `{"kind": "xid", "code": 79, "message": "GPU has fallen off the bus"}`,
/// `{"kind": "row_remap_pending"}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum UnhealthyReason {
    /// Pre-Ampere: retired pages wait for a driver reload or GPU reset to be taken out of use
    /// (`nvidia-smi -q`: `Retired Pages` / `Pending Page Blacklist: Yes`); until then new
    /// work may be given the bad memory.
    RetiredPagesPending,
    /// Ampere and newer: a row waits for a GPU reset to be remapped (`Remapped Rows` /
    /// `Pending: Yes`).
    RowRemapPending,
    /// Ampere and newer: a row remapping failed (`Remapped Rows` / `Remapping Failure
    /// Occurred: Yes`): the GPU can no longer fence off its bad memory.
    RowRemapFailure,
    /// The driver logged an XID that counts (see the module documentation).
    Xid {
        /// The XID, e.g. 79.
        code: u32,
        /// The driver's text after the XID, without the `pid=` and `name=` of the process
        /// concerned, e.g. `GPU has fallen off the bus`; may be empty.
        message: String,
    },
    /// DCGM reported an incident.
    Dcgm {
        /// The health system concerned, e.g. `memory`, `PCIe`.
        system: String,
        /// DCGM's message.
        message: String,
    },
}

impl UnhealthyReason {
    /// A DCGM incident of `system` (e.g. `memory`) saying `message`.
    pub fn dcgm(system: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Dcgm {
            system: system.into(),
            message: message.into(),
        }
    }

    /// The source that tells it.
    pub fn source(&self) -> HealthSource {
        match self {
            Self::RetiredPagesPending | Self::RowRemapPending | Self::RowRemapFailure => {
                HealthSource::NvidiaSmi
            }
            Self::Xid { .. } => HealthSource::KernelLog,
            Self::Dcgm { .. } => HealthSource::Dcgm,
        }
    }
}

/// Where a GPU's health is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum HealthSource {
    /// `nvidia-smi -q`: retired pages and row remapping.
    NvidiaSmi,
    /// The kernel log's XIDs.
    KernelLog,
    /// DCGM's health watches.
    Dcgm,
}

impl std::fmt::Display for UnhealthyReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RetiredPagesPending => f.write_str("retired pages pending"),
            Self::RowRemapPending => f.write_str("row remapping pending (GPU reset needed)"),
            Self::RowRemapFailure => f.write_str("row remapping failed"),
            Self::Xid { code, message } if message.is_empty() => write!(f, "XID {code}"),
            Self::Xid { code, message } => write!(f, "XID {code} ({message})"),
            Self::Dcgm { system, message } => write!(f, "DCGM {system}: {message}"),
        }
    }
}

/// One GPU and the reasons it is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    /// Its UUID (`GPU-…`), the id tasks lock it by.
    pub uuid: String,
    /// Its position in `nvidia-smi`'s list (0-based; DCGM's GPU id).
    pub index: u32,
    /// Its PCI bus id as `nvidia-smi` prints it, e.g. `00000000:3B:00.0`.
    pub bus_id: String,
    /// Why it must not take new tasks; empty when healthy.
    pub reasons: Vec<UnhealthyReason>,
}

impl GpuHealth {
    /// Whether no reason keeps it from new tasks.
    pub fn is_healthy(&self) -> bool {
        self.reasons.is_empty()
    }

    fn add(&mut self, reason: UnhealthyReason) {
        if !self.reasons.contains(&reason) {
            self.reasons.push(reason);
        }
    }
}

/// A GPU named by its position in `nvidia-smi`'s list (DCGM's GPU id) or by its UUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuRef<'a> {
    /// The 0-based index.
    Index(u32),
    /// The UUID (`GPU-…`).
    Uuid(&'a str),
}

/// The health of the host's NVIDIA GPUs at one probe.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealthReport {
    /// Every GPU seen, by index, with its reasons (empty: healthy).
    pub gpus: Vec<GpuHealth>,
    /// What could not be read this time (`nvidia-smi -q` failing, the kernel log unreadable),
    /// as messages. When not empty the report is partial: the reasons that source would have
    /// given are missing, and when `nvidia-smi` failed only GPUs with XIDs are listed.
    pub errors: Vec<String>,
    /// The sources that could not be read ([`GpuHealthReport::unreadable`]): only their
    /// reasons are missing. Errors without a source here leave every source in doubt.
    #[serde(skip)]
    pub unread: Vec<HealthSource>,
}

impl GpuHealthReport {
    /// The GPU with this UUID.
    pub fn get(&self, uuid: &str) -> Option<&GpuHealth> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// The GPUs with at least one reason.
    pub fn unhealthy(&self) -> impl Iterator<Item = &GpuHealth> {
        self.gpus.iter().filter(|g| !g.is_healthy())
    }

    /// The UUIDs of the GPUs with at least one reason, in index order.
    pub fn unhealthy_ids(&self) -> Vec<String> {
        self.unhealthy().map(|g| g.uuid.clone()).collect()
    }

    /// `source` could not be read, for `error`.
    pub fn unreadable(&mut self, source: HealthSource, error: impl Into<String>) {
        self.errors.push(error.into());
        if !self.unread.contains(&source) {
            self.unread.push(source);
        }
    }

    /// Whether what `source` says is missing from this report: it could not be read, or
    /// some source could not be and did not say which.
    pub fn missing(&self, source: HealthSource) -> bool {
        self.unread.contains(&source) || (!self.errors.is_empty() && self.unread.is_empty())
    }

    /// Adds `reason` to `gpu` (once), listing it first (as `gpu` has it, without its reasons)
    /// where the report lacks it: a GPU its source could not read that another source blames
    /// (the XIDs of a GPU fallen off the bus, DCGM's incident, a reason carried over from an
    /// earlier probe). The list stays in index order.
    pub fn add_reason_listed(&mut self, gpu: &GpuHealth, reason: UnhealthyReason) {
        if self.get(&gpu.uuid).is_none() {
            self.gpus.push(GpuHealth {
                reasons: Vec::new(),
                ..gpu.clone()
            });
            self.gpus.sort_by_key(|g| g.index);
        }
        self.add_reason(GpuRef::Uuid(&gpu.uuid), reason);
    }

    /// Adds `reason` to `gpu` (once). Returns false, changing nothing, when the report has no
    /// such GPU.
    pub fn add_reason(&mut self, gpu: GpuRef<'_>, reason: UnhealthyReason) -> bool {
        let found = self.gpus.iter_mut().find(|g| match gpu {
            GpuRef::Index(i) => g.index == i,
            GpuRef::Uuid(u) => g.uuid == u,
        });
        match found {
            Some(g) => {
                g.add(reason);
                true
            }
            None => false,
        }
    }
}

// ------------------------------------------------------------------------------ PCI address

/// A PCI device address without its function (`domain:bus:device`), the part of a GPU's bus
/// id that the driver's XID records carry. `nvidia-smi` prints `00000000:3B:00.0`, an XID
/// record `0000:3b:00`: both parse to the same address. Displays as `0000:3b:00`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    domain: u32,
    bus: u8,
    device: u8,
}

impl PciAddress {
    /// Parses `[domain:]bus:device[.function]` in hexadecimal, any case, any domain width up
    /// to 8 digits (a missing domain is 0); `None` when it is not one.
    pub fn parse(text: &str) -> Option<Self> {
        let parts: Vec<&str> = text.trim().split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [domain, bus, device] => (*domain, *bus, *device),
            [bus, device] => ("0", *bus, *device),
            _ => return None,
        };
        let device = match device.split_once('.') {
            Some((device, function)) => {
                hex(function, 1)?;
                device
            }
            None => device,
        };
        let domain = u32::try_from(hex(domain, 8)?).ok()?;
        let bus = u8::try_from(hex(bus, 2)?).ok()?;
        let device = u8::try_from(hex(device, 2)?).ok()?;
        Some(Self {
            domain,
            bus,
            device,
        })
    }
}

/// `text` as a hexadecimal number of 1 to `max_digits` digits.
fn hex(text: &str, max_digits: usize) -> Option<u64> {
    if text.is_empty() || text.len() > max_digits || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(text, 16).ok()
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}",
            self.domain, self.bus, self.device
        )
    }
}

// ---------------------------------------------------------------------------- nvidia-smi -q

/// `Yes`/`No`; `None` for `N/A` and anything else.
fn flag(value: &str) -> Option<bool> {
    if value.eq_ignore_ascii_case("yes") {
        Some(true)
    } else if value.eq_ignore_ascii_case("no") {
        Some(false)
    } else {
        None
    }
}

/// Splits `Key    : value` at the first colon followed by a space or the end of the line
/// (bus ids such as `00000000:3B:00.0` have colons too); `None` for a section header.
fn split_field(line: &str) -> (&str, Option<&str>) {
    let bytes = line.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b':' && bytes.get(i + 1).is_none_or(|next| *next == b' ') {
            return (line[..i].trim(), Some(line[i + 1..].trim()));
        }
    }
    (line.trim(), None)
}

/// One GPU section being read.
struct Section {
    index: u32,
    bus_id: String,
    uuid: Option<String>,
    reasons: Vec<UnhealthyReason>,
}

impl Section {
    fn field(&mut self, path: &[(usize, String)], key: &str, value: &str) {
        let is = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
        let reason = match path {
            [] if is(key, "GPU UUID") => {
                if !value.is_empty() && !value.eq_ignore_ascii_case("N/A") {
                    self.uuid = Some(value.to_owned());
                }
                return;
            }
            // `Pending Page Blacklist` in the recordings seen (R510 to R560); any `Pending…`
            // label of the section means the same.
            [(_, s)]
                if is(s, "Retired Pages") && key.to_ascii_lowercase().starts_with("pending") =>
            {
                UnhealthyReason::RetiredPagesPending
            }
            [(_, s)] if is(s, "Remapped Rows") && is(key, "Pending") => {
                UnhealthyReason::RowRemapPending
            }
            [(_, s)] if is(s, "Remapped Rows") && is(key, "Remapping Failure Occurred") => {
                UnhealthyReason::RowRemapFailure
            }
            _ => return,
        };
        match flag(value) {
            Some(true) if !self.reasons.contains(&reason) => self.reasons.push(reason),
            Some(_) => {}
            None if value.eq_ignore_ascii_case("N/A") => {}
            None => tracing::debug!(bus_id = %self.bus_id, key, value,
                "unexpected value in nvidia-smi -q; taken as no fault"),
        }
    }

    fn finish(self, gpus: &mut Vec<GpuHealth>) {
        match self.uuid {
            Some(uuid) => gpus.push(GpuHealth {
                uuid,
                index: self.index,
                bus_id: self.bus_id,
                reasons: self.reasons,
            }),
            None => tracing::warn!(bus_id = %self.bus_id,
                "a GPU in nvidia-smi -q has no UUID; its health is not reported"),
        }
    }
}

/// Parses `nvidia-smi -q` (the full text report): one section per GPU, opened by a line
/// `GPU 00000000:3B:00.0` at the left margin, its fields indented by four spaces a level.
/// Returns each GPU with a UUID, indexed by its position in the report, with the reasons read
/// from `Retired Pages` and `Remapped Rows` (see the module documentation). Other sections,
/// their `Pending` fields included (`MIG Mode`, `ECC Mode`, …), are not read.
///
/// An output with no GPU section is an error, unless it says `Attached GPUs : 0`.
pub fn parse_nvidia_smi_query(out: &str) -> Result<Vec<GpuHealth>> {
    let mut gpus = Vec::new();
    let mut current: Option<Section> = None;
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut sections: u32 = 0;
    let mut attached_none = false;
    for line in out.lines() {
        let text = line.trim_start();
        if text.trim().is_empty() {
            continue;
        }
        let indent = line.len() - text.len();
        let (key, value) = split_field(text);
        if indent == 0 {
            path.clear();
            if let Some(section) = current.take() {
                section.finish(&mut gpus);
            }
            if key.eq_ignore_ascii_case("Attached GPUs") && value == Some("0") {
                attached_none = true;
            }
            if let (None, Some(bus_id)) = (value, key.strip_prefix("GPU "))
                && PciAddress::parse(bus_id).is_some()
            {
                current = Some(Section {
                    index: sections,
                    bus_id: bus_id.trim().to_owned(),
                    uuid: None,
                    reasons: Vec::new(),
                });
                sections += 1;
            }
            continue;
        }
        let Some(section) = current.as_mut() else {
            continue;
        };
        while path.last().is_some_and(|(i, _)| *i >= indent) {
            path.pop();
        }
        match value {
            None => path.push((indent, key.to_owned())),
            Some(value) => section.field(&path, key, value),
        }
    }
    if let Some(section) = current.take() {
        section.finish(&mut gpus);
    }
    if sections == 0 && !attached_none {
        return Err(ResourcesError::Parse {
            tool: "nvidia-smi",
            why: "no GPU section in the output of nvidia-smi -q".to_owned(),
        });
    }
    Ok(gpus)
}

/// Parses `nvidia-smi --query-gpu=uuid,pci.bus_id --format=csv,noheader` (`GPU-…,
/// 00000000:3B:00.0` a line) into GPUs without reasons, indexed by line: a bus map for
/// [`XidMonitor::learn`] when `nvidia-smi -q` has not run yet.
pub fn parse_nvidia_smi_bus_ids(out: &str) -> Result<Vec<GpuHealth>> {
    let mut gpus = Vec::new();
    for (index, line) in out.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [uuid, bus_id] = fields.as_slice() else {
            return Err(ResourcesError::Parse {
                tool: "nvidia-smi",
                why: format!(
                    "expected 2 fields (uuid, pci.bus_id), got {}: {line:?}",
                    fields.len()
                ),
            });
        };
        if uuid.is_empty() || PciAddress::parse(bus_id).is_none() {
            return Err(ResourcesError::Parse {
                tool: "nvidia-smi",
                why: format!("no uuid or no PCI bus id: {line:?}"),
            });
        }
        gpus.push(GpuHealth {
            uuid: (*uuid).to_owned(),
            index: u32::try_from(index).unwrap_or(u32::MAX),
            bus_id: (*bus_id).to_owned(),
            reasons: Vec::new(),
        });
    }
    Ok(gpus)
}

// -------------------------------------------------------------------------------- XID lines

/// One XID record of the kernel log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidLine {
    /// The GPU's PCI address.
    pub pci: PciAddress,
    /// The XID.
    pub code: u32,
    /// The driver's text after the XID, without the leading `pid=…` and `name=…` of the
    /// process concerned and without a final period; may be empty.
    pub message: String,
}

/// Reads the XID of a kernel log line: `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has
/// fallen off the bus.` after the prefix of one of the formats it reads (the
/// shim itself reads `/dev/kmsg`: `3,1234,5678,-;`; also `dmesg`'s `[12345.678901] `, `dmesg
/// -x`'s `kern  :err   : `, a BSD syslog `… kernel: `), with or without the
/// `PCI:` tag, with a MIG instance after the address (`(PCI:0000:01:00 GPU-I:05)`: the parent
/// GPU's address counts). `None` for any other line.
///
/// The tag must begin the line's message: a message of another kind that quotes it (Yama's
/// `ptrace attach of "…" was attempted by "<command line>"`, with a command line a container
/// chose) is not an XID, nor is a `/dev/kmsg` record of a facility other than the kernel's.
pub fn parse_xid_line(line: &str) -> Option<XidLine> {
    const TAG: &str = "NVRM: Xid (";
    let (inside, rest) = kernel_message(line)?.strip_prefix(TAG)?.split_once(')')?;
    let inside = inside.trim();
    let address = inside
        .strip_prefix("PCI:")
        .unwrap_or(inside)
        .split_whitespace()
        .next()?;
    let pci = PciAddress::parse(address)?;
    let rest = rest.strip_prefix(':')?.trim_start();
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let code = rest[..digits].parse().ok()?;
    let mut message = rest[digits..].trim_start_matches(',').trim();
    for item in ["pid=", "name="] {
        if let Some(after) = message.strip_prefix(item) {
            message = after.split_once(',').map_or("", |(_, m)| m).trim();
        }
    }
    Some(XidLine {
        pci,
        code,
        message: message.trim_end_matches('.').trim_end().to_owned(),
    })
}

fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// A `/dev/kmsg` record (`prio,seq,usec,flags[,…];message`): its priority, its sequence
/// number (when it parses) and its message.
fn kmsg_record(line: &str) -> Option<(u64, Option<u64>, &str)> {
    let (head, message) = line.split_once(';')?;
    let fields: Vec<&str> = head.split(',').collect();
    match fields.as_slice() {
        [prio, seq, usec, _, ..] if all_digits(prio) && all_digits(usec) => {
            Some((prio.parse().ok()?, seq.parse().ok(), message))
        }
        _ => None,
    }
}

/// A text log line after its header, trimmed: `dmesg -r`'s `<3>`, then `dmesg -x`'s
/// `kern  :err   : ` or a BSD syslog `… kernel: `; what follows may be a `[…]` timestamp.
fn after_text_header(line: &str) -> &str {
    let mut rest = line.trim_start();
    if let Some((level, after)) = rest.strip_prefix('<').and_then(|r| r.split_once('>'))
        && all_digits(level)
    {
        rest = after;
    }
    let word = |s: &str| {
        let s = s.trim();
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase())
    };
    if let Some((facility, after)) = rest.split_once(':')
        && word(facility)
        && let Some((level, after)) = after.split_once(':')
        && word(level)
    {
        rest = after;
    } else if let Some((_, after)) = rest.split_once(" kernel: ") {
        rest = after;
    }
    rest.trim_start()
}

/// The message of a kernel log line, after what comes before it: `/dev/kmsg`'s
/// `prio,seq,usec,flags[,…];` (`None` unless the record is of the kernel's own facility: one
/// user space wrote is not the driver's), `dmesg -r`'s `<3>`, `dmesg -x`'s `kern  :err   : `,
/// a syslog `… kernel: `, then a `[…]` timestamp and a `[T123]` caller id.
fn kernel_message(line: &str) -> Option<&str> {
    if let Some((prio, _, message)) = kmsg_record(line) {
        // The facility is `prio >> 3`; the kernel's is 0.
        return (prio < 8).then_some(message);
    }
    let mut rest = after_text_header(line);
    if let Some((_, after)) = rest.strip_prefix('[').and_then(|r| r.split_once(']')) {
        rest = after.trim_start();
        if let Some((caller, after)) = rest.strip_prefix('[').and_then(|r| r.split_once(']'))
            && let Some(id) = caller.trim().strip_prefix(['T', 'C'])
            && all_digits(id)
        {
            rest = after.trim_start();
        }
    }
    Some(rest)
}

/// Where a kernel log line sits, when its format says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    /// `/dev/kmsg`'s record sequence number: unique and increasing within a boot.
    Seq(u64),
    /// `dmesg`'s timestamp, in microseconds since boot: increasing, not unique.
    Monotonic(u64),
}

/// The position of `line`: a `/dev/kmsg` record (`prio,seq,usec,flags[,…];message`), or a
/// `dmesg` line whose first item is a `[seconds.fraction]` timestamp (after `dmesg -r`'s
/// `<3>`, `dmesg -x`'s `kern  :err   : `, or a syslog `… kernel: `).
fn position(line: &str) -> Option<Position> {
    if let Some((_, seq, _)) = kmsg_record(line) {
        return seq.map(Position::Seq);
    }
    let (stamp, _) = after_text_header(line).strip_prefix('[')?.split_once(']')?;
    let (seconds, fraction) = stamp.trim().split_once('.')?;
    if fraction.is_empty()
        || fraction.len() > 9
        || !fraction.bytes().all(|b| b.is_ascii_digit())
        || !seconds.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let seconds: u64 = seconds.parse().ok()?;
    let micros: u64 = format!("{fraction:0<6}")[..6].parse().ok()?;
    seconds
        .checked_mul(1_000_000)?
        .checked_add(micros)
        .map(Position::Monotonic)
}

/// How far the kernel log has been read, so that a record read again is not counted again.
#[derive(Debug, Default)]
struct Cursor {
    seq: Option<u64>,
    monotonic: Option<u64>,
    /// The lines read at `monotonic` (timestamps are not unique).
    at_monotonic: Vec<String>,
}

impl Cursor {
    /// Whether `line` is new; moves past it. A line without a position is always new.
    fn advance(&mut self, line: &str) -> bool {
        match position(line) {
            Some(Position::Seq(seq)) => {
                if self.seq.is_some_and(|last| seq <= last) {
                    return false;
                }
                self.seq = Some(seq);
                true
            }
            Some(Position::Monotonic(t)) => match self.monotonic {
                Some(last) if t < last => false,
                Some(last) if t == last => {
                    if self.at_monotonic.iter().any(|l| l == line) {
                        return false;
                    }
                    self.at_monotonic.push(line.to_owned());
                    true
                }
                _ => {
                    self.monotonic = Some(t);
                    self.at_monotonic = vec![line.to_owned()];
                    true
                }
            },
            None => true,
        }
    }
}

// ------------------------------------------------------------------------------ XID policy

/// Which XIDs make a GPU unhealthy: all but the skipped ones ([`DEFAULT_SKIPPED_XIDS`] and the
/// operator's), or none when XID checks are off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidPolicy {
    skipped: Vec<u32>,
    all_skipped: bool,
}

impl Default for XidPolicy {
    /// [`DEFAULT_SKIPPED_XIDS`] skipped.
    fn default() -> Self {
        Self {
            skipped: DEFAULT_SKIPPED_XIDS.to_vec(),
            all_skipped: false,
        }
    }
}

impl XidPolicy {
    /// [`DEFAULT_SKIPPED_XIDS`] and `extra` skipped.
    pub fn skipping(extra: impl IntoIterator<Item = u32>) -> Self {
        let mut policy = Self::default();
        policy.skipped.extend(extra);
        policy.skipped.sort_unstable();
        policy.skipped.dedup();
        policy
    }

    /// No XID counts.
    pub fn disabled() -> Self {
        Self {
            skipped: Vec::new(),
            all_skipped: true,
        }
    }

    /// The operator's list, read as the device plugin reads `DP_DISABLE_HEALTHCHECKS`:
    /// `all` or `xids` (any case) turns XID checks off; otherwise comma-separated XIDs skipped
    /// in addition to the defaults. Blank items are ignored; malformed ones are logged and
    /// ignored.
    pub fn parse_skip_list(list: &str) -> Self {
        let mut extra = Vec::new();
        for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item.eq_ignore_ascii_case("all") || item.eq_ignore_ascii_case("xids") {
                return Self::disabled();
            }
            match item.parse() {
                Ok(code) => extra.push(code),
                Err(_) => tracing::warn!(item, "ignoring a malformed XID in the skip list"),
            }
        }
        Self::skipping(extra)
    }

    /// Whether XID `code` makes its GPU unhealthy.
    pub fn counts(&self, code: u32) -> bool {
        !self.all_skipped && !self.skipped.contains(&code)
    }

    /// Whether XID checks are off.
    pub fn is_disabled(&self) -> bool {
        self.all_skipped
    }

    /// The skipped XIDs, ascending (empty when checks are off: all are).
    pub fn skipped(&self) -> &[u32] {
        &self.skipped
    }
}

// ----------------------------------------------------------------------------- XID tracker

/// An XID that counts, newly read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// The GPU's UUID.
    pub uuid: String,
    /// The XID.
    pub code: u32,
    /// The driver's text ([`XidLine::message`]).
    pub message: String,
}

/// The pure core of [`XidMonitor`]: the GPUs by PCI address, the cursor in the kernel log, the
/// XIDs that count per GPU (one entry per XID code, with its first message).
#[derive(Debug, Default)]
pub struct XidTracker {
    policy: XidPolicy,
    cursor: Cursor,
    gpus: BTreeMap<PciAddress, GpuHealth>,
    xids: BTreeMap<String, Vec<(u32, String)>>,
}

impl XidTracker {
    /// A tracker counting the XIDs `policy` counts, knowing no GPU yet.
    pub fn new(policy: XidPolicy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// The policy.
    pub fn policy(&self) -> &XidPolicy {
        &self.policy
    }

    /// Learns which GPU sits at which PCI address (their reasons are not read). A GPU once
    /// learnt stays known: a GPU that fell off the bus may be missing from the next
    /// `nvidia-smi`, and its XIDs must still find it.
    pub fn learn<'a>(&mut self, gpus: impl IntoIterator<Item = &'a GpuHealth>) {
        for gpu in gpus {
            match PciAddress::parse(&gpu.bus_id) {
                Some(address) => {
                    self.gpus.insert(
                        address,
                        GpuHealth {
                            reasons: Vec::new(),
                            ..gpu.clone()
                        },
                    );
                }
                None => tracing::warn!(uuid = %gpu.uuid, bus_id = %gpu.bus_id,
                    "cannot read a GPU's PCI bus id; its XIDs will not be found"),
            }
        }
    }

    /// Reads kernel log `lines` (oldest first): skips those read before, forgets every XID at
    /// a driver load record, and returns the new XIDs that count on known GPUs. An XID on an
    /// unknown PCI address is logged and ignored.
    pub fn scan(&mut self, lines: &str) -> Vec<XidEvent> {
        let mut events = Vec::new();
        for line in lines.lines() {
            if !self.cursor.advance(line) {
                continue;
            }
            if kernel_message(line).is_some_and(|m| m.starts_with(DRIVER_LOADED)) {
                if !self.xids.is_empty() {
                    tracing::info!(gpus = ?self.xids.keys().collect::<Vec<_>>(),
                        "NVIDIA driver loaded again; forgetting the GPUs' XIDs");
                }
                self.xids.clear();
                continue;
            }
            let Some(xid) = parse_xid_line(line) else {
                continue;
            };
            if !self.policy.counts(xid.code) {
                tracing::debug!(pci = %xid.pci, xid = xid.code, message = %xid.message,
                    "XID skipped by the policy");
                continue;
            }
            let Some(gpu) = self.gpus.get(&xid.pci) else {
                tracing::warn!(pci = %xid.pci, xid = xid.code, line,
                    "XID on a PCI address that is not a known GPU; ignored");
                continue;
            };
            tracing::warn!(gpu = %gpu.uuid, pci = %xid.pci, xid = xid.code,
                message = %xid.message, "XID: GPU unhealthy");
            let list = self.xids.entry(gpu.uuid.clone()).or_default();
            if !list.iter().any(|(code, _)| *code == xid.code) {
                list.push((xid.code, xid.message.clone()));
            }
            events.push(XidEvent {
                uuid: gpu.uuid.clone(),
                code: xid.code,
                message: xid.message,
            });
        }
        events
    }

    /// The XID reasons of each GPU that has any, by UUID.
    pub fn reasons(&self) -> BTreeMap<String, Vec<UnhealthyReason>> {
        self.xids
            .iter()
            .map(|(uuid, xids)| {
                let reasons = xids
                    .iter()
                    .map(|(code, message)| UnhealthyReason::Xid {
                        code: *code,
                        message: message.clone(),
                    })
                    .collect();
                (uuid.clone(), reasons)
            })
            .collect()
    }

    /// Adds the XID reasons to `report`; a GPU with XIDs that the report lacks (it fell off
    /// the bus, or `nvidia-smi` failed) is added from what was learnt of it.
    pub fn apply(&self, report: &mut GpuHealthReport) {
        for (uuid, reasons) in self.reasons() {
            let listed = report.get(&uuid).cloned();
            let Some(gpu) = listed.or_else(|| self.gpus.values().find(|g| g.uuid == uuid).cloned())
            else {
                continue;
            };
            for reason in reasons {
                report.add_reason_listed(&gpu, reason);
            }
        }
    }

    /// Forgets the XIDs of the GPU with this UUID (an operator's decision); returns whether it
    /// had any. Records already read stay read.
    pub fn clear(&mut self, uuid: &str) -> bool {
        self.xids.remove(uuid).is_some()
    }

    /// Forgets every GPU's XIDs.
    pub fn clear_all(&mut self) {
        self.xids.clear();
    }
}

// ------------------------------------------------------------------------------ kernel log

/// A source of kernel log lines.
#[async_trait]
pub trait KernelLog: Send + Sync {
    /// The lines available now, oldest first. May return lines an earlier call returned (the
    /// tracker's cursor skips a line it has read when the line carries a `/dev/kmsg` sequence
    /// number or a `dmesg` timestamp; a line with neither counts every time it is returned).
    async fn read(&self) -> Result<String>;
}

/// The kernel log device `/dev/kmsg`, or a file of kernel log lines in its place (tests).
///
/// Each read opens it and reads every record the kernel still holds (the device starts a new
/// reader at the oldest), without blocking; the tracker's cursor drops the records read
/// before. Reading `/dev/kmsg` needs `CAP_SYSLOG` where `kernel.dmesg_restrict` is 1.
#[derive(Debug, Clone)]
pub struct Kmsg {
    path: PathBuf,
}

impl Default for Kmsg {
    /// [`KMSG`].
    fn default() -> Self {
        Self::at(KMSG)
    }
}

impl Kmsg {
    /// The kernel log at `path`.
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Where it reads.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn read_nonblocking(path: &Path) -> Result<String> {
    use fs_err::os::unix::fs::OpenOptionsExt as _;
    let mut file = fs_err::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path)
        .map_err(io_err("open", path))?;
    let mut out = Vec::new();
    let mut buffer = vec![0_u8; KMSG_READ_BUFFER];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(buffer.get(..n).unwrap_or_default()),
            // No record left (the device), or the end (a file).
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // EPIPE: records were overwritten before they were read; the device has moved
            // on to the oldest one left.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                tracing::debug!(path = %path.display(), "kernel log records lost while reading");
            }
            Err(e) => return Err(ResourcesError::io("read", path, e)),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[async_trait]
impl KernelLog for Kmsg {
    async fn read(&self) -> Result<String> {
        let path = self.path.clone();
        blocking("read the kernel log", move || read_nonblocking(&path)).await
    }
}

// ----------------------------------------------------------------------------- XID monitor

/// Reads XIDs from a [`KernelLog`] into an [`XidTracker`]. Safe to share.
pub struct XidMonitor {
    log: Arc<dyn KernelLog>,
    tracker: Mutex<XidTracker>,
    /// Whether the last read failed (its error is logged once, not at every read).
    failing: Mutex<bool>,
}

impl std::fmt::Debug for XidMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XidMonitor")
            .field("tracker", &self.tracker)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl XidMonitor {
    /// A monitor reading `log`, counting the XIDs `policy` counts.
    pub fn new(log: Arc<dyn KernelLog>, policy: XidPolicy) -> Self {
        Self {
            log,
            tracker: Mutex::new(XidTracker::new(policy)),
            failing: Mutex::new(false),
        }
    }

    /// [`XidTracker::learn`].
    pub fn learn(&self, gpus: &[GpuHealth]) {
        lock(&self.tracker).learn(gpus);
    }

    /// Whether some GPU's PCI address is known ([`XidMonitor::learn`]).
    pub fn knows_gpus(&self) -> bool {
        !lock(&self.tracker).gpus.is_empty()
    }

    /// Reads the log once and returns the new XIDs that count ([`XidTracker::scan`]).
    /// Nothing is read when the policy counts no XID. A read that fails is an error (logged
    /// when reads start failing and when they recover).
    pub async fn poll(&self) -> Result<Vec<XidEvent>> {
        if lock(&self.tracker).policy().is_disabled() {
            return Ok(Vec::new());
        }
        let read = self.log.read().await;
        let was_failing = std::mem::replace(&mut *lock(&self.failing), read.is_err());
        match read {
            Ok(lines) => {
                if was_failing {
                    tracing::info!("the kernel log is readable again");
                }
                Ok(lock(&self.tracker).scan(&lines))
            }
            Err(e) => {
                if !was_failing {
                    tracing::warn!(error = %error_chain(&e),
                        "cannot read the kernel log; XIDs are not seen");
                }
                Err(e)
            }
        }
    }

    /// [`XidTracker::apply`].
    pub fn apply(&self, report: &mut GpuHealthReport) {
        lock(&self.tracker).apply(report);
    }

    /// [`XidTracker::reasons`].
    pub fn reasons(&self) -> BTreeMap<String, Vec<UnhealthyReason>> {
        lock(&self.tracker).reasons()
    }

    /// [`XidTracker::clear`].
    pub fn clear(&self, uuid: &str) -> bool {
        let cleared = lock(&self.tracker).clear(uuid);
        if cleared {
            tracing::info!(gpu = uuid, "GPU's XIDs cleared by the operator");
        }
        cleared
    }

    /// [`XidTracker::clear_all`].
    pub fn clear_all(&self) {
        lock(&self.tracker).clear_all();
        tracing::info!("every GPU's XIDs cleared by the operator");
    }
}

// ----------------------------------------------------------------------------------- probe

/// The `nvidia-smi` arguments of the probe.
pub const NVIDIA_SMI_QUERY_ARGS: [&str; 1] = ["-q"];

/// Probes the NVIDIA GPUs' health: runs `nvidia-smi -q` through `runner`, teaches `xids` the
/// GPUs' bus ids, reads the kernel log's new records and adds the XIDs that count.
///
/// Never fails: what could not be read goes to [`GpuHealthReport::errors`] and the rest is
/// reported. A failing `nvidia-smi` whose output still has GPU sections is read; a kernel log
/// that cannot be read leaves the XIDs known so far.
pub async fn probe_nvidia_health(runner: &dyn CommandRunner, xids: &XidMonitor) -> GpuHealthReport {
    let mut report = GpuHealthReport::default();
    let command = Command::new("nvidia-smi").args(NVIDIA_SMI_QUERY_ARGS);
    let smi = HealthSource::NvidiaSmi;
    match runner.run(&command).await {
        Err(e) => report.unreadable(smi, error_chain(&ResourcesError::from(e))),
        Ok(out) => {
            if !out.success() {
                let failure = ResourcesError::from(out.failure(&command));
                report.unreadable(smi, error_chain(&failure));
            }
            match parse_nvidia_smi_query(&out.stdout) {
                Ok(gpus) => report.gpus = gpus,
                // A failed run has said why already.
                Err(e) if out.success() => report.unreadable(smi, error_chain(&e)),
                Err(_) => {}
            }
        }
    }
    xids.learn(&report.gpus);
    // Not before a GPU's bus is known: the records read would be passed over as XIDs of no
    // known GPU, and never read again (an XID logged before a restart of the shim, whose
    // first `nvidia-smi -q` failed, would put its GPU back in service).
    if xids.knows_gpus()
        && let Err(e) = xids.poll().await
    {
        report.unreadable(HealthSource::KernelLog, error_chain(&e));
    }
    xids.apply(&mut report);
    for error in &report.errors {
        tracing::debug!(%error, "GPU health probe incomplete");
    }
    report
}

/// A source of the host's GPU health, which the engine polls to keep unhealthy GPUs from new
/// tasks: [`NvidiaHealth`] on an NVIDIA host (and an embedder's own, e.g. joined with DCGM).
#[async_trait::async_trait]
pub trait GpuHealthSource: Send + Sync {
    /// The health now: every GPU with its reasons (none when healthy), and what could not be
    /// read.
    async fn probe(&self) -> GpuHealthReport;
}

/// The NVIDIA sources: `nvidia-smi -q` and the XIDs of the kernel log
/// ([`probe_nvidia_health`]).
pub struct NvidiaHealth {
    runner: Arc<dyn CommandRunner>,
    xids: XidMonitor,
}

impl std::fmt::Debug for NvidiaHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvidiaHealth")
            .field("xids", &self.xids)
            .finish_non_exhaustive()
    }
}

impl NvidiaHealth {
    /// Runs `nvidia-smi` with `runner` and reads XIDs through `xids`.
    pub fn new(runner: Arc<dyn CommandRunner>, xids: XidMonitor) -> Self {
        Self { runner, xids }
    }

    /// The XID monitor (an operator's clear goes through it).
    pub fn xids(&self) -> &XidMonitor {
        &self.xids
    }
}

#[async_trait::async_trait]
impl GpuHealthSource for NvidiaHealth {
    async fn probe(&self) -> GpuHealthReport {
        probe_nvidia_health(self.runner.as_ref(), &self.xids).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_of_both_spellings_are_equal() {
        let smi = PciAddress::parse("00000000:3B:00.0").unwrap();
        let xid = PciAddress::parse("0000:3b:00").unwrap();
        assert_eq!(smi, xid);
        assert_eq!(smi.to_string(), "0000:3b:00");
        assert_eq!(PciAddress::parse("3b:00.0"), Some(smi));
        assert_eq!(
            PciAddress::parse("00000009:01:00.0").unwrap().to_string(),
            "0009:01:00"
        );
        for bad in [
            "",
            "GPU",
            "0000:3b",
            "0000:3g:00",
            "0000:3b:00.x",
            "1:2:3:4",
            "000000000:3b:00",
        ] {
            assert_eq!(PciAddress::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn positions() {
        assert_eq!(
            position("3,1234,5678,-;NVRM: Xid (PCI:0000:3b:00): 79, x"),
            Some(Position::Seq(1234))
        );
        assert_eq!(
            position("4,77,1,-,caller=T1;text; more"),
            Some(Position::Seq(77))
        );
        assert_eq!(
            position("[12345.678] NVRM: x"),
            Some(Position::Monotonic(12_345_678_000))
        );
        assert_eq!(
            position("[    5.000001] x"),
            Some(Position::Monotonic(5_000_001))
        );
        assert_eq!(
            position("kern  :err   : [ 7.5] NVRM: x"),
            Some(Position::Monotonic(7_500_000))
        );
        assert_eq!(
            position("<3>[ 7.5] NVRM: x"),
            Some(Position::Monotonic(7_500_000))
        );
        assert_eq!(
            position("Jun  7 19:32:16 host kernel: [12.25] NVRM: x"),
            Some(Position::Monotonic(12_250_000))
        );
        assert_eq!(position("kern  :err   : NVRM: x"), None);
        assert_eq!(position("[Sun Feb 23 16:24:18 2025] NVRM: x"), None);
        assert_eq!(position("NVRM: x [3.5]"), None);
        assert_eq!(position("foo; bar"), None);
    }

    #[test]
    fn split_fields() {
        assert_eq!(
            split_field("GPU 00000000:3B:00.0"),
            ("GPU 00000000:3B:00.0", None)
        );
        assert_eq!(
            split_field("Bus Id                            : 00000000:3B:00.0"),
            ("Bus Id", Some("00000000:3B:00.0"))
        );
        assert_eq!(split_field("Remapped Rows"), ("Remapped Rows", None));
        assert_eq!(split_field("Processes :"), ("Processes", Some("")));
    }
}
