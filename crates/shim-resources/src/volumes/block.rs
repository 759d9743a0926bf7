//! [`BlockVolumes`], the real [`VolumeManager`]: find the device, probe it, format it only
//! when it is confirmed blank and the volume asks for it, mount it; unmount on release. The
//! blocking work runs on tokio's blocking pool; operations are locked per mount point and per
//! device.

use std::io::{Seek as _, SeekFrom};
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shim_task::{MountedVolume, VolumeBackend, VolumeSpec};
use shim_util::{Command, CommandRunner, KeyedLocks, error_chain};

use super::mounter::{Mounter, SystemMounter};
use super::parse::{Probe, aws_fallback_names, find_aws_device, parse_blkid};
use super::{VolumeConfig, VolumeManager};
use crate::blocking::blocking;
use crate::error::{ResourcesError, Result, io_err};

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
    mount_points: KeyedLocks<PathBuf>,
    devices: KeyedLocks<PathBuf>,
}

impl std::fmt::Debug for BlockVolumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockVolumes")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
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
            return Err(ResourcesError::UnsupportedVolume {
                volume: spec.name.as_str().to_owned(),
                why,
            });
        }
        Ok(match spec.backend {
            VolumeBackend::Gcp => {
                let n = &spec.device_name;
                if n.is_empty() || n.contains(['/', '\0']) || n == ".." {
                    return Err(ResourcesError::DeviceNotFound {
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
                return Err(ResourcesError::UnsupportedVolume {
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
                return Err(ResourcesError::DeviceNotFound {
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
                return Err(ResourcesError::NotBlockDevice {
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

    async fn mounted_from(&self, path: &Path, device: &Path) -> Result<Option<bool>> {
        let (mounter, path, device) = (self.mounter.clone(), path.to_owned(), device.to_owned());
        blocking("read the mount table", move || {
            mounter.mounted_from(&path, &device)
        })
        .await
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
            Err(e) => return Err(ResourcesError::io("create", dir, e)),
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
        return Err(ResourcesError::io("chmod", mount_point, e));
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
        let _mount_point = self.mount_points.lock(mount_point.clone()).await;
        let real_device = {
            let d = device.clone();
            blocking("resolve the device", move || {
                Ok(fs_err::canonicalize(&d).unwrap_or(d))
            })
            .await?
        };
        let _device = self.devices.lock(real_device.clone()).await;
        if self.is_mounted(&mount_point).await? {
            // Only this volume's own file system counts as mounted (another task's of the
            // same volume, one a restart found): not whatever is mounted at its path.
            if self.mounted_from(&mount_point, &real_device).await? == Some(false) {
                return Err(ResourcesError::MountedElsewhere {
                    volume: name.to_owned(),
                    mount_point,
                    device,
                });
            }
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
                return Err(ResourcesError::NotAFilesystem { device, signature });
            }
            Probe::Blank if !spec.init_fs => {
                return Err(ResourcesError::NoFilesystem {
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
        let _mount_point = self.mount_points.lock(mp.clone()).await;
        if !self.is_mounted(&mp).await? {
            tracing::debug!(mount_point = %mp.display(), "not mounted; nothing to release");
            return Ok(());
        }
        if !volume.device.is_empty()
            && self.mounted_from(&mp, Path::new(&volume.device)).await? == Some(false)
        {
            tracing::warn!(volume = %volume.name, mount_point = %mp.display(), device = %volume.device,
                "another file system than the volume's is mounted there; left alone");
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
    use crate::fake::{FakeCall, FakeMounter};
    use shim_util::fake::ScriptedCommandRunner;

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
        assert!(matches!(e, ResourcesError::Unmount { .. }), "{e}");
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
            assert!(matches!(e, ResourcesError::UnsupportedVolume { .. }), "{e}");
            assert!(e.to_string().contains("\"my-data\""), "{e}");
        }
        assert!(runner.calls().is_empty());
        assert!(mounter.calls().is_empty());
    }
}
