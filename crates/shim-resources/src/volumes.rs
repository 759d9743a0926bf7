//! Block volumes: find the cloud's device, format it only when it is confirmed blank and the
//! volume asks for it, mount it under the volumes root, and unmount it on release.
//!
//! Safety rules, in order:
//! - the device must be a block device of non-zero size (waited for, bounded);
//! - a device with any file system is never formatted, `init_fs` or not;
//! - "blank" (`blkid -p` exit code 2) must be confirmed by [`VolumeConfig::blank_confirmations`]
//!   further probes before `mkfs.ext4` runs, and only when `init_fs` is set; a blank device
//!   without `init_fs` is an error;
//! - a signature that is not a file system (partition table, RAID member, LUKS) is an error;
//! - only the root of a file system we created is made world-writable (0777);
//! - release unmounts only a path under the volumes root that `/proc/self/mountinfo` lists as a
//!   mount point; anything else is a no-op, so release is idempotent.

use std::io::{Seek as _, SeekFrom};
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::Deserialize;
use shim_task::{MountedVolume, VolumeBackend, VolumeSpec};

use crate::cmd::CommandRunner;
use crate::error::{Error, Result, io_err};

/// Where volumes are mounted by default.
pub const DEFAULT_VOLUMES_ROOT: &str = "/mnt/disks/dstack-volumes";

/// Prepares and releases a task's volumes.
#[async_trait]
pub trait VolumeManager: Send + Sync {
    /// Finds the volume's device, formats it if needed and allowed, and mounts it at
    /// `<volumes root>/<name>`. Already mounted there: returns it as is.
    async fn prepare(&self, spec: &VolumeSpec) -> Result<MountedVolume>;

    /// Unmounts the volume if its mount point is mounted; a no-op otherwise (idempotent).
    async fn release(&self, volume: &MountedVolume) -> Result<()>;

    /// The host path a volume of this name is mounted at.
    fn mount_point(&self, name: &str) -> PathBuf;
}

/// Paths and time limits of [`BlockVolumes`].
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    /// Mount points are `<root>/<volume name>`.
    pub root: PathBuf,
    /// How long to wait for the resolved device to be a non-empty block device.
    pub device_wait: Duration,
    /// How long to poll for an AWS device to appear in `lsblk`.
    pub resolve_wait: Duration,
    /// Pause between polls.
    pub poll_interval: Duration,
    /// How many further probes must confirm "blank" before formatting.
    pub blank_confirmations: u32,
    /// Pause between those probes.
    pub confirm_interval: Duration,
    /// Where GCP's `google-<device name>` links live.
    pub gcp_by_id_dir: PathBuf,
    /// Where `lsblk` names and `/dev/…` device names are looked up.
    pub dev_dir: PathBuf,
    /// The mount table to read.
    pub mountinfo: PathBuf,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from(DEFAULT_VOLUMES_ROOT),
            device_wait: Duration::from_secs(10),
            resolve_wait: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            blank_confirmations: 3,
            confirm_interval: Duration::from_secs(1),
            gcp_by_id_dir: PathBuf::from("/dev/disk/by-id"),
            dev_dir: PathBuf::from("/dev"),
            mountinfo: PathBuf::from("/proc/self/mountinfo"),
        }
    }
}

impl VolumeConfig {
    /// Defaults with another volumes root.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            ..Self::default()
        }
    }

    /// Short waits, for tests.
    pub fn fast(mut self) -> Self {
        self.device_wait = Duration::from_millis(500);
        self.resolve_wait = Duration::from_millis(500);
        self.poll_interval = Duration::from_millis(50);
        self.confirm_interval = Duration::from_millis(10);
        self
    }
}

/// The real [`VolumeManager`]: block devices, `blkid`, `mkfs.ext4`, mount(2), umount(2).
///
/// Probing, formatting, mounting and unmounting are serialized within one manager, so two
/// tasks sharing a blank volume can never both decide to format it.
pub struct BlockVolumes {
    config: VolumeConfig,
    runner: Arc<dyn CommandRunner>,
    ops: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for BlockVolumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockVolumes")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What `blkid -p` found on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No signature at all (exit code 2).
    Blank,
    /// A file system of this type.
    Filesystem(String),
    /// A signature that is not a file system (partition table, RAID member, crypto).
    Other(String),
}

/// Parses `blkid -p -o export <dev>` output with its exit code.
pub fn parse_blkid(code: Option<i32>, stdout: &str) -> Option<Probe> {
    match code {
        Some(2) => Some(Probe::Blank),
        Some(0) => {
            let mut ty = None;
            let mut usage = None;
            let mut pttype = None;
            for line in stdout.lines() {
                if let Some((k, v)) = line.split_once('=') {
                    match k.trim() {
                        "TYPE" => ty = Some(v.trim().to_owned()),
                        "USAGE" => usage = Some(v.trim().to_owned()),
                        "PTTYPE" => pttype = Some(v.trim().to_owned()),
                        _ => {}
                    }
                }
            }
            Some(match (ty.filter(|t| !t.is_empty()), usage.as_deref()) {
                (Some(t), None | Some("filesystem")) => Probe::Filesystem(t),
                (Some(t), Some(u)) => Probe::Other(format!("{t} ({u})")),
                (None, _) => Probe::Other(
                    pttype.map_or_else(|| "unknown".to_owned(), |p| format!("partition table {p}")),
                ),
            })
        }
        _ => None,
    }
}

#[derive(Debug, Deserialize)]
struct Lsblk {
    blockdevices: Vec<LsblkDev>,
}

#[derive(Debug, Deserialize)]
struct LsblkDev {
    name: String,
    #[serde(default)]
    serial: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    children: Vec<LsblkDev>,
}

impl LsblkDev {
    /// The first partition's name, or the device's own name when it has none.
    fn first_partition_or_self(&self) -> &str {
        self.children
            .iter()
            .find(|c| c.kind.as_deref() == Some("part"))
            .map_or(self.name.as_str(), |c| c.name.as_str())
    }
}

fn normalize_vol(id: &str) -> String {
    id.trim().replace('-', "").to_ascii_lowercase()
}

/// From `lsblk -J -o NAME,SERIAL,TYPE` output: the kernel name of the device (its first
/// partition if partitioned) whose serial is the AWS volume id without its dash (`vol0abc` for
/// `vol-0abc`), or whose name is `fallback_name` (e.g. `xvdf`) when no serial matches.
pub fn find_aws_device(
    lsblk_json: &str,
    volume_id: &str,
    fallbacks: &[String],
) -> Result<Option<String>> {
    let parsed: Lsblk = serde_json::from_str(lsblk_json).map_err(|e| Error::Parse {
        tool: "lsblk",
        why: e.to_string(),
    })?;
    let want = normalize_vol(volume_id);
    if !want.is_empty() {
        if let Some(d) = parsed.blockdevices.iter().find(|d| {
            d.serial
                .as_deref()
                .is_some_and(|s| s.trim().starts_with("vol") && normalize_vol(s) == want)
        }) {
            return Ok(Some(d.first_partition_or_self().to_owned()));
        }
    }
    for name in fallbacks {
        if let Some(d) = parsed.blockdevices.iter().find(|d| &d.name == name) {
            return Ok(Some(d.first_partition_or_self().to_owned()));
        }
    }
    Ok(None)
}

/// The kernel names an AWS `device_name` may appear as: `/dev/sdf` → `sdf`, `xvdf`.
pub fn aws_fallback_names(device_name: &str) -> Vec<String> {
    let Some(rest) = device_name.strip_prefix("/dev/") else {
        return Vec::new();
    };
    if rest.is_empty() || rest.contains('/') || rest.contains("..") {
        return Vec::new();
    }
    let mut names = vec![rest.to_owned()];
    if let Some(letter) = rest.strip_prefix("sd") {
        names.push(format!("xvd{letter}"));
    }
    names
}

/// Whether `path` is a mount point according to a mountinfo table's content.
pub fn is_mount_point_in(mountinfo: &str, path: &Path) -> bool {
    mountinfo.lines().any(|line| {
        line.split(' ')
            .nth(4)
            .is_some_and(|mp| Path::new(&unescape_mountinfo(mp)) == path)
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            if let Some(oct) = b.get(i + 1..i + 4) {
                if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                    let v = oct
                        .iter()
                        .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
                    if let Ok(v) = u8::try_from(v) {
                        out.push(v);
                        i += 4;
                        continue;
                    }
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl BlockVolumes {
    /// Volumes under `config.root`, tools run with `runner`.
    pub fn new(config: VolumeConfig, runner: Arc<dyn CommandRunner>) -> Self {
        Self {
            config,
            runner,
            ops: tokio::sync::Mutex::new(()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &VolumeConfig {
        &self.config
    }

    /// The device of a volume spec, polled for (AWS) and checked to be a ready block device.
    pub async fn resolve_device(&self, spec: &VolumeSpec) -> Result<PathBuf> {
        let device = self.find_device(spec).await?;
        self.wait_block_device(&device).await?;
        Ok(device)
    }

    /// The device path of a volume spec (AWS: polled for up to `resolve_wait`), not yet
    /// checked to be a block device.
    pub async fn find_device(&self, spec: &VolumeSpec) -> Result<PathBuf> {
        if let Some(why) = spec.problem() {
            return Err(Error::UnsupportedVolume {
                volume: spec.name.as_str().to_owned(),
                why,
            });
        }
        Ok(match spec.backend {
            VolumeBackend::Gcp => {
                let n = &spec.device_name;
                if n.is_empty() || n.contains(['/', '\0']) || n == ".." {
                    return Err(Error::DeviceNotFound {
                        volume: spec.name.as_str().to_owned(),
                        waited: Duration::ZERO,
                        detail: format!("invalid GCP device name {n:?}"),
                    });
                }
                self.config.gcp_by_id_dir.join(format!("google-{n}"))
            }
            VolumeBackend::Aws => self.resolve_aws(spec).await?,
            VolumeBackend::Other(_) => {
                // `problem()` refused it above; kept for exhaustiveness.
                return Err(Error::UnsupportedVolume {
                    volume: spec.name.as_str().to_owned(),
                    why: format!("backend {:?} is not supported", spec.backend.as_str()),
                });
            }
        })
    }

    async fn resolve_aws(&self, spec: &VolumeSpec) -> Result<PathBuf> {
        let start = Instant::now();
        let fallbacks = aws_fallback_names(&spec.device_name);
        let args = ["-J", "-o", "NAME,SERIAL,TYPE"];
        loop {
            let out = self
                .runner
                .run("lsblk", &args)
                .await?
                .check("lsblk", &args)?;
            if let Some(name) = find_aws_device(&out.stdout, &spec.volume_id, &fallbacks)? {
                return Ok(self.config.dev_dir.join(name));
            }
            // lsblk may not list a device node that exists (e.g. a symlink by device name).
            for name in &fallbacks {
                let p = self.config.dev_dir.join(name);
                if p.exists() {
                    return Ok(p);
                }
            }
            if start.elapsed() >= self.config.resolve_wait {
                return Err(Error::DeviceNotFound {
                    volume: spec.name.as_str().to_owned(),
                    waited: self.config.resolve_wait,
                    detail: format!(
                        "no block device with serial of {:?} nor named {:?}",
                        spec.volume_id, spec.device_name
                    ),
                });
            }
            tokio::time::sleep(self.config.poll_interval).await;
        }
    }

    /// Waits (bounded) until `device` is a block device of non-zero size.
    pub async fn wait_block_device(&self, device: &Path) -> Result<u64> {
        let start = Instant::now();
        loop {
            let why = match block_device_size(device) {
                Ok(size) if size > 0 => return Ok(size),
                Ok(_) => "size is zero".to_owned(),
                Err(e) => e,
            };
            if start.elapsed() >= self.config.device_wait {
                return Err(Error::NotBlockDevice {
                    device: device.to_owned(),
                    waited: self.config.device_wait,
                    detail: why,
                });
            }
            tokio::time::sleep(self.config.poll_interval).await;
        }
    }

    /// One `blkid -p` probe.
    pub async fn probe(&self, device: &Path) -> Result<Probe> {
        let dev = device.to_string_lossy();
        let args = ["-p", "-o", "export", dev.as_ref()];
        let out = self.runner.run("blkid", &args).await?;
        parse_blkid(out.code, &out.stdout).ok_or_else(|| out.failure("blkid", &args))
    }

    /// Probes, and re-probes a "blank" verdict `blank_confirmations` times: blank only if every
    /// probe says so.
    pub async fn probe_confirmed(&self, device: &Path) -> Result<Probe> {
        let first = self.probe(device).await?;
        if first != Probe::Blank {
            return Ok(first);
        }
        for attempt in 0..self.config.blank_confirmations {
            tokio::time::sleep(self.config.confirm_interval).await;
            let p = self.probe(device).await?;
            if p != Probe::Blank {
                tracing::warn!(device = %device.display(), attempt, probe = ?p,
                    "a signature appeared on re-probe; not formatting");
                return Ok(p);
            }
        }
        Ok(Probe::Blank)
    }

    fn is_mounted(&self, path: &Path) -> Result<bool> {
        let table = fs_err::read_to_string(&self.config.mountinfo)
            .map_err(io_err("read", &self.config.mountinfo))?;
        Ok(is_mount_point_in(&table, path))
    }
}

/// The size of a block device, or why it is not one.
fn block_device_size(device: &Path) -> std::result::Result<u64, String> {
    let meta = fs_err::metadata(device).map_err(|e| e.to_string())?;
    if !meta.file_type().is_block_device() {
        return Err("not a block device".to_owned());
    }
    let mut f = fs_err::File::open(device).map_err(|e| e.to_string())?;
    f.seek(SeekFrom::End(0)).map_err(|e| e.to_string())
}

fn create_dirs(path: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut p = path;
    while !p.exists() {
        missing.push(p.to_owned());
        match p.parent() {
            Some(parent) => p = parent,
            None => break,
        }
    }
    for dir in missing.iter().rev() {
        match fs_err::create_dir(dir) {
            Ok(()) => fs_err::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(io_err("chmod", dir))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("create", dir, e)),
        }
    }
    Ok(())
}

#[async_trait]
impl VolumeManager for BlockVolumes {
    async fn prepare(&self, spec: &VolumeSpec) -> Result<MountedVolume> {
        let name = spec.name.as_str();
        let mount_point = self.mount_point(name);
        let device = self.resolve_device(spec).await?;
        let mounted = MountedVolume {
            name: name.to_owned(),
            mount_point: mount_point.to_string_lossy().into_owned(),
            device: device.to_string_lossy().into_owned(),
        };
        let _serialized = self.ops.lock().await;
        if self.is_mounted(&mount_point)? {
            tracing::info!(volume = name, mount_point = %mount_point.display(),
                "volume already mounted");
            return Ok(mounted);
        }
        let (fstype, created) = match self.probe_confirmed(&device).await? {
            Probe::Filesystem(t) => {
                tracing::info!(volume = name, device = %device.display(), fstype = %t,
                    "device has a file system; not formatting");
                (t, false)
            }
            Probe::Other(signature) => {
                return Err(Error::NotAFilesystem { device, signature });
            }
            Probe::Blank if !spec.init_fs => {
                return Err(Error::NoFilesystem {
                    volume: name.to_owned(),
                    device,
                });
            }
            Probe::Blank => {
                tracing::info!(volume = name, device = %device.display(), "formatting ext4");
                let dev = device.to_string_lossy();
                let args = ["-F", dev.as_ref()];
                self.runner
                    .run("mkfs.ext4", &args)
                    .await?
                    .check("mkfs.ext4", &args)?;
                ("ext4".to_owned(), true)
            }
        };
        create_dirs(&mount_point)?;
        nix::mount::mount(
            Some(device.as_path()),
            mount_point.as_path(),
            Some(fstype.as_str()),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|source| Error::Mount {
            device: device.clone(),
            target: mount_point.clone(),
            source,
        })?;
        if created {
            if let Err(e) =
                fs_err::set_permissions(&mount_point, std::fs::Permissions::from_mode(0o777))
            {
                let _ = nix::mount::umount(mount_point.as_path());
                return Err(Error::io("chmod", &mount_point, e));
            }
        }
        tracing::info!(volume = name, device = %device.display(),
            mount_point = %mount_point.display(), created, "volume mounted");
        Ok(mounted)
    }

    async fn release(&self, volume: &MountedVolume) -> Result<()> {
        let mp = PathBuf::from(&volume.mount_point);
        if !mp.is_absolute() || !mp.starts_with(&self.config.root) || mp == self.config.root {
            tracing::warn!(mount_point = %mp.display(), root = %self.config.root.display(),
                "not unmounting a path outside the volumes root");
            return Ok(());
        }
        if mp
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            tracing::warn!(mount_point = %mp.display(), "not unmounting a path with '..'");
            return Ok(());
        }
        let _serialized = self.ops.lock().await;
        if !self.is_mounted(&mp)? {
            tracing::debug!(mount_point = %mp.display(), "not mounted; nothing to release");
            return Ok(());
        }
        match nix::mount::umount(mp.as_path()) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {
                tracing::info!(volume = %volume.name, mount_point = %mp.display(), "volume unmounted");
                Ok(())
            }
            Err(source) => Err(Error::Unmount { target: mp, source }),
        }
    }

    fn mount_point(&self, name: &str) -> PathBuf {
        self.config.root.join(name)
    }
}
