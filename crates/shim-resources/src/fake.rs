//! Fakes for the tests of this crate and the engine's (`cfg(test)` or feature
//! `test-support`): volumes, the mount system calls and authorized_keys that record calls and
//! fail on demand, a fixed user table ([`StaticUserDb`]) and a GPU health source set by hand
//! ([`FakeGpuHealth`]). GPUs themselves need no fake: use
//! [`crate::gpu::HostGpus::fake_nvidia`] with a real [`crate::gpu::GpuLock`], or a
//! [`crate::gpu::GpuDetector`] over a temporary device root with a [`ScriptedCommandRunner`](shim_util::fake::ScriptedCommandRunner)
//! (the command runner's fake, from [`shim_util`], re-exported here).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use shim_task::{MountedVolume, PublicKey, TaskId, VolumeSpec};

use crate::error::{ResourcesError, Result};
use crate::keys::{AuthorizedKeys, UserDb, UserEntry};
use crate::volumes::{Mounter, VolumeManager};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A call made to a fake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeCall {
    /// `prepare` of the volume with this name.
    Prepare(String),
    /// `release` of the volume mounted at this path.
    Release(String),
    /// `add` for a task, user, key count.
    AddKeys(TaskId, String, usize),
    /// `restore` for a task.
    RestoreKeys(TaskId),
    /// `hold_unknown` for a task and its user, if known.
    HoldUnknown(TaskId, Option<String>),
    /// `remove` for a task and user.
    RemoveKeys(TaskId, String),
    /// [`Mounter::mount`] of a device at a mount point with a file system type.
    Mount(PathBuf, PathBuf, String),
    /// [`Mounter::unmount`] of a mount point.
    Unmount(PathBuf),
}

/// In-memory volumes: `prepare` "mounts" under a fake root, `release` "unmounts"; volumes named
/// in [`FakeVolumes::fail_prepare`] / [`FakeVolumes::fail_release`] fail, and releases wait
/// while [`FakeVolumes::hold_releases`] holds them (a slow unmount).
#[derive(Debug)]
pub struct FakeVolumes {
    root: PathBuf,
    mounted: Mutex<BTreeSet<String>>,
    fail_prepare: Mutex<BTreeSet<String>>,
    fail_release: Mutex<BTreeSet<String>>,
    calls: Mutex<Vec<FakeCall>>,
    /// Releases wait while true.
    held: tokio::sync::watch::Sender<bool>,
}

impl FakeVolumes {
    /// Fake volumes "mounted" under `root` (nothing is created there).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            mounted: Mutex::default(),
            fail_prepare: Mutex::default(),
            fail_release: Mutex::default(),
            calls: Mutex::default(),
            held: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Makes every release wait (after it is recorded) until [`FakeVolumes::let_releases_go`].
    pub fn hold_releases(&self) {
        self.held.send_replace(true);
    }

    /// Lets held releases, and the following ones, proceed.
    pub fn let_releases_go(&self) {
        self.held.send_replace(false);
    }

    /// Makes `prepare` of volume `name` fail (or succeed again with `false`).
    pub fn fail_prepare(&self, name: &str, fail: bool) {
        set(&self.fail_prepare, name, fail);
    }

    /// Makes `release` of volume `name` fail (or succeed again with `false`).
    pub fn fail_release(&self, name: &str, fail: bool) {
        set(&self.fail_release, name, fail);
    }

    /// The names of the volumes currently "mounted".
    pub fn mounted(&self) -> Vec<String> {
        lock(&self.mounted).iter().cloned().collect()
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<FakeCall> {
        lock(&self.calls).clone()
    }
}

fn set(m: &Mutex<BTreeSet<String>>, name: &str, on: bool) {
    let mut s = lock(m);
    if on {
        s.insert(name.to_owned());
    } else {
        s.remove(name);
    }
}

fn fake_error(what: &str) -> ResourcesError {
    shim_util::CommandOutput::exit(1, "injected failure")
        .failure(&shim_util::Command::new("fake").arg(what))
        .into()
}

#[async_trait]
impl VolumeManager for FakeVolumes {
    async fn prepare(&self, spec: &VolumeSpec) -> Result<MountedVolume> {
        let name = spec.name.as_str().to_owned();
        lock(&self.calls).push(FakeCall::Prepare(name.clone()));
        if lock(&self.fail_prepare).contains(&name) {
            return Err(fake_error(&format!("prepare {name}")));
        }
        lock(&self.mounted).insert(name.clone());
        Ok(MountedVolume {
            mount_point: self.mount_point(&name).to_string_lossy().into_owned(),
            device: format!("/dev/fake-{name}"),
            name,
        })
    }

    async fn release(&self, volume: &MountedVolume) -> Result<()> {
        lock(&self.calls).push(FakeCall::Release(volume.mount_point.clone()));
        let mut held = self.held.subscribe();
        // The sender lives as long as self: wait_for cannot fail here.
        let _ = held.wait_for(|h| !h).await;
        if lock(&self.fail_release).contains(&volume.name) {
            return Err(fake_error(&format!("release {}", volume.name)));
        }
        lock(&self.mounted).remove(&volume.name);
        Ok(())
    }

    fn mount_point(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }
}

/// A recording [`Mounter`]: an in-memory mount table, failures on demand, and an optional
/// delay in `unmount` (an ext4 flush), for testing that unmounts block nothing else.
#[derive(Debug, Default)]
pub struct FakeMounter {
    mounted: Mutex<BTreeSet<PathBuf>>,
    fail: Mutex<BTreeSet<PathBuf>>,
    unmount_delay: Mutex<Duration>,
    calls: Mutex<Vec<FakeCall>>,
}

impl FakeMounter {
    /// An empty mount table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks `target` as mounted (e.g. by an earlier shim process).
    pub fn set_mounted(&self, target: impl Into<PathBuf>) {
        lock(&self.mounted).insert(target.into());
    }

    /// Makes `mount` and `unmount` at `target` fail (or succeed again with `false`).
    pub fn fail_at(&self, target: impl Into<PathBuf>, fail: bool) {
        let mut f = lock(&self.fail);
        let target = target.into();
        if fail {
            f.insert(target);
        } else {
            f.remove(&target);
        }
    }

    /// Makes every `unmount` block the calling thread this long first.
    pub fn set_unmount_delay(&self, delay: Duration) {
        *lock(&self.unmount_delay) = delay;
    }

    /// The mount points currently mounted.
    pub fn mounted(&self) -> Vec<PathBuf> {
        lock(&self.mounted).iter().cloned().collect()
    }

    /// Every mount and unmount so far.
    pub fn calls(&self) -> Vec<FakeCall> {
        lock(&self.calls).clone()
    }
}

impl Mounter for FakeMounter {
    fn mount(&self, device: &Path, target: &Path, fstype: &str) -> Result<()> {
        lock(&self.calls).push(FakeCall::Mount(
            device.to_owned(),
            target.to_owned(),
            fstype.to_owned(),
        ));
        if lock(&self.fail).contains(target) {
            return Err(ResourcesError::Mount {
                device: device.to_owned(),
                target: target.to_owned(),
                source: nix::errno::Errno::EIO,
            });
        }
        lock(&self.mounted).insert(target.to_owned());
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<()> {
        lock(&self.calls).push(FakeCall::Unmount(target.to_owned()));
        let delay = *lock(&self.unmount_delay);
        std::thread::sleep(delay);
        if lock(&self.fail).contains(target) {
            return Err(ResourcesError::Unmount {
                target: target.to_owned(),
                source: nix::errno::Errno::EBUSY,
            });
        }
        lock(&self.mounted).remove(target);
        Ok(())
    }

    fn is_mounted(&self, target: &Path) -> Result<bool> {
        Ok(lock(&self.mounted).contains(target))
    }
}

/// In-memory authorized_keys: the live set per task and the unknown holds, with the same
/// registration semantics as the real manager (marked keys of a user = keys of that user's live
/// tasks), and injectable failures.
#[derive(Debug, Default)]
pub struct FakeAuthorizedKeys {
    live: Mutex<BTreeMap<TaskId, (String, Vec<PublicKey>)>>,
    unknown: Mutex<BTreeMap<TaskId, Option<String>>>,
    fail: Mutex<bool>,
    calls: Mutex<Vec<FakeCall>>,
}

impl FakeAuthorizedKeys {
    /// An empty fake.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `add` and `remove` fail (or succeed again with `false`).
    pub fn set_fail(&self, fail: bool) {
        *lock(&self.fail) = fail;
    }

    /// The fingerprints a user's file would hold as shim-owned lines.
    pub fn keys_of(&self, user: &str) -> BTreeSet<String> {
        lock(&self.live)
            .values()
            .filter(|(u, _)| u == user)
            .flat_map(|(_, k)| k.iter().map(|k| k.fingerprint().to_owned()))
            .collect()
    }

    /// The live tasks whose keys are unknown, with their users (`None`: unknown).
    pub fn unknown_holds(&self) -> Vec<(TaskId, Option<String>)> {
        lock(&self.unknown)
            .iter()
            .map(|(t, u)| (t.clone(), u.clone()))
            .collect()
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<FakeCall> {
        lock(&self.calls).clone()
    }
}

#[async_trait]
impl AuthorizedKeys for FakeAuthorizedKeys {
    async fn add(&self, task: &TaskId, user: &str, keys: &[PublicKey]) -> Result<()> {
        lock(&self.calls).push(FakeCall::AddKeys(task.clone(), user.to_owned(), keys.len()));
        if *lock(&self.fail) {
            return Err(fake_error("authorized_keys add"));
        }
        if user.is_empty() && !keys.is_empty() {
            return Err(ResourcesError::MissingUser { keys: keys.len() });
        }
        lock(&self.unknown).remove(task);
        lock(&self.live).insert(task.clone(), (user.to_owned(), keys.to_vec()));
        Ok(())
    }

    fn restore(&self, task: &TaskId, user: &str, keys: &[PublicKey]) {
        lock(&self.calls).push(FakeCall::RestoreKeys(task.clone()));
        lock(&self.unknown).remove(task);
        lock(&self.live).insert(task.clone(), (user.to_owned(), keys.to_vec()));
    }

    fn hold_unknown(&self, task: &TaskId, user: Option<&str>) {
        let user = user.filter(|u| !u.is_empty()).map(str::to_owned);
        lock(&self.calls).push(FakeCall::HoldUnknown(task.clone(), user.clone()));
        lock(&self.unknown).insert(task.clone(), user);
    }

    async fn remove(&self, task: &TaskId, user: &str, _keys: &[PublicKey]) -> Result<()> {
        lock(&self.calls).push(FakeCall::RemoveKeys(task.clone(), user.to_owned()));
        lock(&self.live).remove(task);
        lock(&self.unknown).remove(task);
        if *lock(&self.fail) {
            return Err(fake_error("authorized_keys remove"));
        }
        Ok(())
    }
}

/// A fixed user table, the fake of the passwd database: each user maps to a home directory,
/// owned by the current uid/gid unless given otherwise.
#[derive(Debug, Clone, Default)]
pub struct StaticUserDb {
    users: HashMap<String, UserEntry>,
}

impl StaticUserDb {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `user` with home `home`, owned by the current process's uid and gid.
    pub fn with_user(mut self, user: &str, home: impl Into<PathBuf>) -> Self {
        self.users.insert(
            user.to_owned(),
            UserEntry {
                home: home.into(),
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
            },
        );
        self
    }

    /// Adds `user` with an explicit entry.
    pub fn with_entry(mut self, user: &str, entry: UserEntry) -> Self {
        self.users.insert(user.to_owned(), entry);
        self
    }
}

impl UserDb for StaticUserDb {
    fn lookup(&self, user: &str) -> Result<UserEntry> {
        self.users
            .get(user)
            .cloned()
            .ok_or_else(|| ResourcesError::UnknownUser {
                user: user.to_owned(),
            })
    }
}

/// A GPU health source whose answer is set by hand: every GPU of a host healthy until
/// [`FakeGpuHealth::set_reasons`] says otherwise.
#[derive(Debug)]
pub struct FakeGpuHealth {
    report: Mutex<crate::gpu::GpuHealthReport>,
}

impl FakeGpuHealth {
    /// Every GPU of `host` healthy.
    pub fn new(host: &crate::gpu::HostGpus) -> Self {
        let gpus = host.gpus.iter().map(|g| crate::gpu::GpuHealth {
            uuid: g.id.clone(),
            index: g.index,
            bus_id: String::new(),
            reasons: Vec::new(),
        });
        let report = crate::gpu::GpuHealthReport {
            gpus: gpus.collect(),
            ..crate::gpu::GpuHealthReport::default()
        };
        Self {
            report: Mutex::new(report),
        }
    }

    /// From the next probe on, the GPU at `position` in the host's list is unhealthy for
    /// `reasons` (none: healthy). Returns false, changing nothing, past the end of the list.
    pub fn set_reasons(&self, position: usize, reasons: Vec<crate::gpu::UnhealthyReason>) -> bool {
        match lock(&self.report).gpus.get_mut(position) {
            Some(gpu) => {
                gpu.reasons = reasons;
                true
            }
            None => false,
        }
    }
}

#[async_trait]
impl crate::gpu::GpuHealthSource for FakeGpuHealth {
    async fn probe(&self) -> crate::gpu::GpuHealthReport {
        lock(&self.report).clone()
    }
}

#[cfg(test)]
mod tests {
    use shim_task::{TaskName, VolumeBackend};

    use super::*;

    fn spec(name: &str) -> VolumeSpec {
        VolumeSpec {
            backend: VolumeBackend::Gcp,
            name: TaskName::new(name).unwrap(),
            volume_id: String::new(),
            init_fs: true,
            device_name: name.to_owned(),
        }
    }

    #[tokio::test]
    async fn fake_volumes_record_and_fail_on_demand() {
        let v = FakeVolumes::new("/fake/volumes");
        let a = v.prepare(&spec("a")).await.unwrap();
        assert_eq!(a.mount_point, "/fake/volumes/a");
        v.fail_prepare("b", true);
        assert!(v.prepare(&spec("b")).await.is_err());
        v.fail_release("a", true);
        assert!(v.release(&a).await.is_err());
        assert_eq!(v.mounted(), vec!["a"]);
        v.fail_release("a", false);
        v.release(&a).await.unwrap();
        assert!(v.mounted().is_empty());
        assert_eq!(
            v.calls(),
            vec![
                FakeCall::Prepare("a".into()),
                FakeCall::Prepare("b".into()),
                FakeCall::Release("/fake/volumes/a".into()),
                FakeCall::Release("/fake/volumes/a".into()),
            ]
        );
    }

    #[tokio::test]
    async fn fake_keys_follow_live_tasks() {
        let k = PublicKey::parse(
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILJGWz0/8QjYK+L+mj9V7g/pcOzi/5qYPRvJ0QrLvroM u",
        )
        .unwrap();
        let f = FakeAuthorizedKeys::new();
        let (a, b) = (TaskId::new("a").unwrap(), TaskId::new("b").unwrap());
        let c = TaskId::new("c").unwrap();
        f.add(&a, "u", std::slice::from_ref(&k)).await.unwrap();
        f.restore(&b, "u", std::slice::from_ref(&k));
        f.hold_unknown(&c, None);
        assert_eq!(f.unknown_holds(), vec![(c.clone(), None)]);
        f.remove(&a, "u", std::slice::from_ref(&k)).await.unwrap();
        assert_eq!(f.keys_of("u").len(), 1, "b still holds it");
        assert!(f.add(&a, "", std::slice::from_ref(&k)).await.is_err());
        f.set_fail(true);
        assert!(f.add(&a, "u", &[]).await.is_err());
        assert!(f.remove(&b, "u", &[]).await.is_err());
        assert!(f.remove(&c, "", &[]).await.is_err());
        assert!(f.keys_of("u").is_empty());
        assert!(f.unknown_holds().is_empty());
        assert_eq!(
            f.calls(),
            vec![
                FakeCall::AddKeys(a.clone(), "u".into(), 1),
                FakeCall::RestoreKeys(b.clone()),
                FakeCall::HoldUnknown(c.clone(), None),
                FakeCall::RemoveKeys(a.clone(), "u".into()),
                FakeCall::AddKeys(a.clone(), String::new(), 1),
                FakeCall::AddKeys(a.clone(), "u".into(), 0),
                FakeCall::RemoveKeys(b, "u".into()),
                FakeCall::RemoveKeys(c, String::new()),
            ]
        );
    }
}
