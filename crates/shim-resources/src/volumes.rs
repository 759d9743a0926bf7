//! Block volumes: find the cloud's device, format it only when it is confirmed blank and the
//! volume asks for it, mount it under the volumes root, and unmount it on release.
//!
//! Safety rules, in order:
//! - the device must be a block device of non-zero size (waited for, bounded);
//! - a device with any file system is never formatted, `init_fs` or not;
//! - "blank" (`blkid -p` exit code 2) must be confirmed by [`VolumeConfig::blank_confirmations`]
//!   further probes before `mkfs.ext4` runs, and only when `init_fs` is set; a blank device
//!   without `init_fs` is an error;
//! - a signature that is not a file system (partition table, RAID member, LUKS) is an error
//!   (a partitioned disk is used by its first partition where the cloud names one: AWS by
//!   `lsblk`, GCP by its `google-<name>-part1` link);
//! - only the root of a file system we created is made world-writable (0777);
//! - release unmounts only a path under the volumes root that `/proc/self/mountinfo` lists as a
//!   mount point; anything else is a no-op, so release is idempotent.
//!
//! Concurrency: mount(2), umount(2) (which can block for seconds while ext4 flushes), the
//! mount table and the directory work go through a [`Mounter`] (the real one is
//! [`SystemMounter`]; a recording fake is `fake::FakeMounter`) and run on tokio's blocking
//! pool, never on an async worker. Operations are serialized per mount point and, for
//! `prepare`, per device (always in that order), so two tasks sharing a blank volume can never
//! both decide to format it, while releases of different volumes run in parallel.

use std::collections::HashMap;
use std::io::{Seek as _, SeekFrom};
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::Deserialize;
use shim_task::{MountedVolume, VolumeBackend, VolumeSpec};

use shim_util::{Command, CommandRunner, error_chain};

use crate::blocking::blocking;
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

/// The mount system calls and the mount table, behind a trait so that the volume logic can be
/// tested with a recording fake (youki's `Syscall` pattern). Blocking: [`BlockVolumes`] calls
/// every method from `tokio::task::spawn_blocking`.
pub trait Mounter: Send + Sync {
    /// Mounts the file system `fstype` on `device` at `target` (which exists).
    fn mount(&self, device: &Path, target: &Path, fstype: &str) -> Result<()>;

    /// Unmounts `target`; a target that is not (or no longer) mounted, or gone, is `Ok`.
    fn unmount(&self, target: &Path) -> Result<()>;

    /// Whether `target` is a mount point.
    fn is_mounted(&self, target: &Path) -> Result<bool>;
}

/// The real [`Mounter`]: mount(2), umount(2) and a mountinfo table.
#[derive(Debug, Clone)]
pub struct SystemMounter {
    mountinfo: PathBuf,
}

impl SystemMounter {
    /// Mount points are read from `mountinfo` (normally `/proc/self/mountinfo`).
    pub fn new(mountinfo: impl Into<PathBuf>) -> Self {
        Self {
            mountinfo: mountinfo.into(),
        }
    }
}

impl Mounter for SystemMounter {
    fn mount(&self, device: &Path, target: &Path, fstype: &str) -> Result<()> {
        nix::mount::mount(
            Some(device),
            target,
            Some(fstype),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|source| Error::Mount {
            device: device.to_owned(),
            target: target.to_owned(),
            source,
        })
    }

    fn unmount(&self, target: &Path) -> Result<()> {
        match nix::mount::umount(target) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => Ok(()),
            Err(source) => Err(Error::Unmount {
                target: target.to_owned(),
                source,
            }),
        }
    }

    fn is_mounted(&self, target: &Path) -> Result<bool> {
        let table =
            fs_err::read_to_string(&self.mountinfo).map_err(io_err("read", &self.mountinfo))?;
        Ok(is_mount_point_in(&table, target))
    }
}

/// One async lock per key (a mount point, a device), created on demand and dropped when no
/// one holds or waits for it.
#[derive(Debug, Default)]
struct KeyedLocks {
    locks: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
}

impl KeyedLocks {
    async fn lock(&self, key: &Path) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            // Only the map refers to it: nobody holds or waits for it.
            map.retain(|_, l| Arc::strong_count(l) > 1);
            map.entry(key.to_owned()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

/// The real [`VolumeManager`]: block devices, `blkid`, `mkfs.ext4`, and a [`Mounter`]
/// (mount(2), umount(2) by default).
///
/// Probing, formatting and mounting are serialized per mount point and per device, and
/// unmounting per mount point, so two tasks sharing a blank volume can never both decide to
/// format it, and a slow unmount holds up nothing else.
pub struct BlockVolumes {
    config: VolumeConfig,
    runner: Arc<dyn CommandRunner>,
    mounter: Arc<dyn Mounter>,
    mount_points: KeyedLocks,
    devices: KeyedLocks,
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
            let mut part_scheme = None;
            for line in stdout.lines() {
                if let Some((k, v)) = line.split_once('=') {
                    match k.trim() {
                        "TYPE" => ty = Some(v.trim().to_owned()),
                        "USAGE" => usage = Some(v.trim().to_owned()),
                        "PTTYPE" => pttype = Some(v.trim().to_owned()),
                        "PART_ENTRY_SCHEME" => part_scheme = Some(v.trim().to_owned()),
                        _ => {}
                    }
                }
            }
            Some(match (ty.filter(|t| !t.is_empty()), usage.as_deref()) {
                (Some(t), None | Some("filesystem")) => Probe::Filesystem(t),
                (Some(t), Some(u)) => Probe::Other(format!("{t} ({u})")),
                // A partition is reported by its entry in the table even when it holds
                // nothing: never "blank" (upstream refuses it too).
                (None, _) => Probe::Other(match (pttype, part_scheme) {
                    (Some(p), _) => format!("partition table {p}"),
                    (None, Some(s)) => format!("a partition ({s}) without a file system"),
                    (None, None) => "unknown".to_owned(),
                }),
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
    if !want.is_empty()
        && let Some(d) = parsed.blockdevices.iter().find(|d| {
            d.serial
                .as_deref()
                .is_some_and(|s| s.trim().starts_with("vol") && normalize_vol(s) == want)
        })
    {
        return Ok(Some(d.first_partition_or_self().to_owned()));
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
        if b[i] == b'\\'
            && let Some(oct) = b.get(i + 1..i + 4)
            && oct.iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = oct
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl BlockVolumes {
    /// Volumes under `config.root`, tools run with `runner`, mounted with mount(2) and
    /// umount(2) ([`SystemMounter`] reading `config.mountinfo`).
    pub fn new(config: VolumeConfig, runner: Arc<dyn CommandRunner>) -> Self {
        let mounter = Arc::new(SystemMounter::new(&config.mountinfo));
        Self {
            config,
            runner,
            mounter,
            mount_points: KeyedLocks::default(),
            devices: KeyedLocks::default(),
        }
    }

    /// Mounts, unmounts and reads the mount table with `mounter` instead.
    pub fn with_mounter(mut self, mounter: Arc<dyn Mounter>) -> Self {
        self.mounter = mounter;
        self
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
                let (by_id, n) = (self.config.gcp_by_id_dir.clone(), n.clone());
                blocking("find the GCP device", move || Ok(gcp_device(&by_id, &n))).await?
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
        let lsblk = Command::new("lsblk").args(["-J", "-o", "NAME,SERIAL,TYPE"]);
        loop {
            let out = self.runner.run(&lsblk).await?.check(&lsblk)?;
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
            let dev = device.to_owned();
            let size = blocking("block device size", move || Ok(block_device_size(&dev))).await?;
            let why = match size {
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
        let blkid = Command::new("blkid")
            .args(["-p", "-o", "export"])
            .arg(device.to_string_lossy());
        let out = self.runner.run(&blkid).await?;
        parse_blkid(out.code(), &out.stdout).ok_or_else(|| out.failure(&blkid).into())
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

    async fn is_mounted(&self, path: &Path) -> Result<bool> {
        let (mounter, path) = (self.mounter.clone(), path.to_owned());
        blocking("read the mount table", move || mounter.is_mounted(&path)).await
    }
}

/// A GCP disk's device, as upstream resolves it (`runner/internal/shim/backends/gcp.go`,
/// `GetRealDeviceName`, after <https://cloud.google.com/compute/docs/disks/disk-symlinks>):
/// its first partition `google-<name>-part1` where that link exists (a partitioned disk is
/// mounted by its first partition), else the disk `google-<name>`.
fn gcp_device(by_id: &Path, name: &str) -> PathBuf {
    let part1 = by_id.join(format!("google-{name}-part1"));
    if fs_err::symlink_metadata(&part1).is_ok() {
        part1
    } else {
        by_id.join(format!("google-{name}"))
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

/// Creates the mount point, mounts, and opens up the root of a file system just created.
fn mount_at(
    mounter: &dyn Mounter,
    device: &Path,
    mount_point: &Path,
    fstype: &str,
    created: bool,
) -> Result<()> {
    create_dirs(mount_point)?;
    mounter.mount(device, mount_point, fstype)?;
    if created
        && let Err(e) = fs_err::set_permissions(mount_point, std::fs::Permissions::from_mode(0o777))
    {
        if let Err(u) = mounter.unmount(mount_point) {
            tracing::warn!(mount_point = %mount_point.display(), error = %error_chain(&u),
                    "cannot unmount after a failed chmod");
        }
        return Err(Error::io("chmod", mount_point, e));
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
        // Mount point first, then device: the same order everywhere, so no deadlock. The
        // device is locked by its resolved path, so two names of one disk share the lock.
        let _mount_point = self.mount_points.lock(&mount_point).await;
        let real_device = {
            let d = device.clone();
            blocking("resolve the device", move || {
                Ok(fs_err::canonicalize(&d).unwrap_or(d))
            })
            .await?
        };
        let _device = self.devices.lock(&real_device).await;
        if self.is_mounted(&mount_point).await? {
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
                let mkfs = Command::new("mkfs.ext4")
                    .arg("-F")
                    .arg(device.to_string_lossy());
                self.runner.run(&mkfs).await?.check(&mkfs)?;
                ("ext4".to_owned(), true)
            }
        };
        {
            let (mounter, device, mount_point) =
                (self.mounter.clone(), device.clone(), mount_point.clone());
            blocking("mount", move || {
                mount_at(&*mounter, &device, &mount_point, &fstype, created)
            })
            .await?;
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
        let _mount_point = self.mount_points.lock(&mp).await;
        if !self.is_mounted(&mp).await? {
            tracing::debug!(mount_point = %mp.display(), "not mounted; nothing to release");
            return Ok(());
        }
        {
            let (mounter, mp) = (self.mounter.clone(), mp.clone());
            blocking("unmount", move || mounter.unmount(&mp)).await?;
        }
        tracing::info!(volume = %volume.name, mount_point = %mp.display(), "volume unmounted");
        Ok(())
    }

    fn mount_point(&self, name: &str) -> PathBuf {
        self.config.root.join(name)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use shim_task::TaskName;

    use super::*;
    use crate::fake::ScriptedCommandRunner;
    use crate::fake::{FakeCall, FakeMounter};

    fn manager(root: &Path, mounter: Arc<FakeMounter>) -> BlockVolumes {
        BlockVolumes::new(
            VolumeConfig::with_root(root).fast(),
            Arc::new(ScriptedCommandRunner::new()),
        )
        .with_mounter(mounter)
    }

    fn volume(root: &Path, name: &str) -> MountedVolume {
        MountedVolume {
            name: name.to_owned(),
            mount_point: root.join(name).to_string_lossy().into_owned(),
            device: format!("/dev/fake-{name}"),
        }
    }

    #[tokio::test]
    async fn release_unmounts_only_what_is_mounted() {
        let root = Path::new("/fake/volumes");
        let mounter = Arc::new(FakeMounter::new());
        mounter.set_mounted(root.join("a"));
        let m = manager(root, mounter.clone());
        m.release(&volume(root, "a")).await.unwrap();
        m.release(&volume(root, "a")).await.unwrap();
        m.release(&volume(root, "b")).await.unwrap();
        assert_eq!(mounter.calls(), vec![FakeCall::Unmount(root.join("a"))]);
        assert!(mounter.mounted().is_empty());
        // A failing unmount is an error naming the mount point; the volume stays mounted.
        mounter.set_mounted(root.join("c"));
        mounter.fail_at(root.join("c"), true);
        let e = m.release(&volume(root, "c")).await.unwrap_err();
        assert!(matches!(e, Error::Unmount { .. }), "{e}");
        assert!(e.to_string().contains("/fake/volumes/c"), "{e}");
        assert_eq!(mounter.mounted(), vec![root.join("c")]);
    }

    // One worker thread: were the unmount run on it, or were releases serialized by one
    // lock, nothing else could progress while it blocks.
    #[tokio::test(flavor = "current_thread")]
    async fn a_slow_unmount_blocks_neither_the_runtime_nor_other_volumes() {
        let root = Path::new("/fake/volumes");
        let mounter = Arc::new(FakeMounter::new());
        for v in ["slow", "fast"] {
            mounter.set_mounted(root.join(v));
        }
        mounter.set_unmount_delay(Duration::from_millis(600));
        let m = Arc::new(manager(root, mounter.clone()));
        let start = Instant::now();
        let slow = {
            let m = m.clone();
            tokio::spawn(async move { m.release(&volume(root, "slow")).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let ticked = start.elapsed();
        let fast = {
            let m = m.clone();
            tokio::spawn(async move { m.release(&volume(root, "fast")).await })
        };
        fast.await.unwrap().unwrap();
        let fast_done = start.elapsed();
        slow.await.unwrap().unwrap();
        let slow_done = start.elapsed();
        assert!(
            ticked < Duration::from_millis(400),
            "runtime blocked: {ticked:?}"
        );
        // Both unmounts ran side by side (each sleeps 600 ms).
        assert!(
            fast_done < Duration::from_millis(1100),
            "serialized: {fast_done:?}"
        );
        assert!(slow_done >= Duration::from_millis(600));
        assert!(mounter.mounted().is_empty());
    }

    #[tokio::test]
    async fn releases_of_one_mount_point_are_serialized() {
        let root = Path::new("/fake/volumes");
        let mounter = Arc::new(FakeMounter::new());
        mounter.set_mounted(root.join("a"));
        mounter.set_unmount_delay(Duration::from_millis(100));
        let m = Arc::new(manager(root, mounter.clone()));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                tokio::spawn(async move { m.release(&volume(root, "a")).await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        // The first unmounts; the others, serialized behind it, find nothing mounted.
        assert_eq!(mounter.calls(), vec![FakeCall::Unmount(root.join("a"))]);
    }

    #[tokio::test]
    async fn unsupported_volume_fails_naming_it_before_any_tool_runs() {
        let root = Path::new("/fake/volumes");
        let mounter = Arc::new(FakeMounter::new());
        let runner = Arc::new(ScriptedCommandRunner::new());
        let m = BlockVolumes::new(VolumeConfig::with_root(root).fast(), runner.clone())
            .with_mounter(mounter.clone());
        for (backend, volume_id, device_name) in [
            (VolumeBackend::Other("azure".into()), "", ""),
            (VolumeBackend::Other(String::new()), "", ""),
            (VolumeBackend::Aws, "", "/dev/sdf"),
            (VolumeBackend::Gcp, "", ""),
        ] {
            let spec = VolumeSpec {
                backend,
                name: TaskName::new("my-data").unwrap(),
                volume_id: volume_id.into(),
                init_fs: true,
                device_name: device_name.into(),
            };
            let e = m.prepare(&spec).await.unwrap_err();
            assert!(matches!(e, Error::UnsupportedVolume { .. }), "{e}");
            assert!(e.to_string().contains("\"my-data\""), "{e}");
        }
        assert!(runner.calls().is_empty());
        assert!(mounter.calls().is_empty());
    }
}
