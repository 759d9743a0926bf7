//! Block volumes on real loop devices: format, mount, unmount. Needs root, `losetup`,
//! `mkfs.ext4`, `blkid` and mount(2); the tests are ignored unless run with `--run-ignored all`,
//! and then need `SHIM_TEST_ROOT=1` and fail loudly if any of it is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use shim_resources::volumes::{Probe, is_mount_point_in};
use shim_resources::{BlockVolumes, ResourcesError, VolumeConfig, VolumeManager};
use shim_task::{MountedVolume, TaskName, VolumeBackend, VolumeSpec};
use shim_util::testing::require_root;
use shim_util::{CommandRunner, SystemCommandRunner};

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A GCP volume spec named `name` on the disk GCP calls `device_name`.
fn gcp_spec(name: &str, device_name: &str, init_fs: bool) -> VolumeSpec {
    VolumeSpec {
        backend: VolumeBackend::Gcp,
        name: TaskName::new(name).unwrap(),
        volume_id: String::new(),
        init_fs,
        device_name: device_name.to_owned(),
    }
}

/// A loop device over a temporary file, with a volumes root and a GCP-style by-id dir linking
/// `google-test-disk` to it. Dropping it unmounts what is left and detaches the device.
struct Loop {
    tmp: tempfile::TempDir,
    dev: PathBuf,
}

/// Writes an MBR with one Linux partition from sector 2048 to the end of a 32 MiB image.
fn write_mbr(img: &Path) {
    let mut mbr = vec![0u8; 512];
    mbr[446 + 4] = 0x83;
    mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    mbr[446 + 12..446 + 16].copy_from_slice(&(65536u32 - 2048).to_le_bytes());
    mbr[510] = 0x55;
    mbr[511] = 0xaa;
    let mut f = fs_err::OpenOptions::new().write(true).open(img).unwrap();
    std::io::Write::write_all(&mut f, &mbr).unwrap();
}

impl Loop {
    /// A `size_mib` MiB file, written by `prepare_file`, attached by `losetup` with `flags`.
    /// Every test starts here, so this is where root is required.
    fn new(size_mib: u64, prepare_file: impl FnOnce(&Path), flags: &[&str]) -> Self {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("disk.img");
        let f = fs_err::File::create(&img).unwrap();
        f.set_len(size_mib * 1024 * 1024).unwrap();
        drop(f);
        prepare_file(&img);
        let args = [flags, &["-f", "--show", img.to_str().unwrap()]].concat();
        let dev = PathBuf::from(run("losetup", &args));
        let lp = Self { tmp, dev };
        fs_err::create_dir(lp.by_id_dir()).unwrap();
        symlink(&lp.dev, lp.by_id("google-test-disk")).unwrap();
        lp
    }

    /// A 32 MiB disk with an MBR and one partition (`write_mbr`), attached with its partitions
    /// scanned, and linked as GCP's udev rules link one: `google-test-disk` to the disk and
    /// `google-test-disk-part1` to its first partition, whose device this returns too.
    fn partitioned() -> (Self, PathBuf) {
        let lp = Self::new(32, write_mbr, &["-P"]);
        let part = PathBuf::from(format!("{}p1", lp.dev.display()));
        // The kernel's scan at attach time does not always add the partition: ask again.
        if !part.exists() {
            run("partx", &["-a", lp.dev_str()]);
        }
        assert!(part.exists(), "{} has no partition device", lp.dev_str());
        symlink(&part, lp.by_id("google-test-disk-part1")).unwrap();
        (lp, part)
    }

    fn blank(size_mib: u64) -> Self {
        Self::new(size_mib, |_| {}, &[])
    }

    /// A blank disk and a manager of it.
    fn blank_managed(size_mib: u64) -> (Self, BlockVolumes) {
        let lp = Self::blank(size_mib);
        let m = lp.manager();
        (lp, m)
    }

    /// The GCP-style by-id dir.
    fn by_id_dir(&self) -> PathBuf {
        self.tmp.path().join("by-id")
    }

    fn by_id(&self, name: &str) -> PathBuf {
        self.by_id_dir().join(name)
    }

    fn root(&self) -> PathBuf {
        self.tmp.path().join("volumes")
    }

    /// Where the volume of `spec` (named `data`) is mounted.
    fn mount_point(&self) -> PathBuf {
        self.root().join("data")
    }

    fn manager(&self) -> BlockVolumes {
        self.manager_with(Arc::new(SystemCommandRunner::default()))
    }

    fn manager_with(&self, runner: Arc<dyn CommandRunner>) -> BlockVolumes {
        let mut config = VolumeConfig::with_root(self.root()).fast();
        config.gcp_by_id_dir = self.by_id_dir();
        BlockVolumes::new(config, runner)
    }

    fn spec(&self, init_fs: bool) -> VolumeSpec {
        gcp_spec("data", "test-disk", init_fs)
    }

    fn dev_str(&self) -> &str {
        self.dev.to_str().unwrap()
    }

    /// `blkid -p` of the disk: its exit code and output.
    fn blkid(&self) -> (Option<i32>, String) {
        let out = Command::new("blkid")
            .args(["-p", "-o", "export", self.dev_str()])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let mp = self.mount_point();
        let table = fs_err::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if is_mount_point_in(&table, &mp) {
            let _ = Command::new("umount").arg("-l").arg(&mp).status();
        }
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

fn is_mounted(p: &Path) -> bool {
    let table = fs_err::read_to_string("/proc/self/mountinfo").unwrap();
    is_mount_point_in(&table, p)
}

fn mode(p: &Path) -> u32 {
    fs_err::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Asserts that the root of the file system mounted at `mp` has the 0755 its owner left.
#[track_caller]
fn assert_mode_kept(mp: &Path) {
    let msg = "a file system we did not create keeps its mode";
    assert_eq!(mode(mp), 0o755, "{msg}");
}

/// Releases `vol` and asserts that its mount point is no longer mounted.
async fn release(m: &BlockVolumes, vol: &MountedVolume) {
    m.release(vol).await.unwrap();
    assert!(!is_mounted(Path::new(&vol.mount_point)), "{vol:?}");
}

/// Prepares each of `specs` in a task of its own, all at once.
async fn prepare_all(m: &Arc<BlockVolumes>, specs: &[VolumeSpec]) -> Vec<MountedVolume> {
    let tasks: Vec<_> = specs
        .iter()
        .map(|spec| {
            let (m, spec) = (m.clone(), spec.clone());
            tokio::spawn(async move { m.prepare(&spec).await })
        })
        .collect();
    let mut vols = Vec::new();
    for t in tasks {
        vols.push(t.await.unwrap().unwrap());
    }
    vols
}

/// Releases each of `vols` in a task of its own, all at once.
async fn release_all(m: &Arc<BlockVolumes>, vols: &[MountedVolume]) {
    let tasks: Vec<_> = vols
        .iter()
        .map(|v| {
            let (m, v) = (m.clone(), v.clone());
            tokio::spawn(async move { m.release(&v).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn blank_device_with_init_fs_is_formatted_mounted_and_released() {
    let (lp, m) = Loop::blank_managed(64);
    let vol = m.prepare(&lp.spec(true)).await.unwrap();
    let mp = lp.mount_point();
    assert_eq!(vol.mount_point, mp.to_string_lossy());
    assert_eq!(vol.device, lp.by_id("google-test-disk").to_string_lossy());
    assert!(is_mounted(&mp));
    let msg = "root of a file system we created is world-writable";
    assert_eq!(mode(&mp), 0o777, "{msg}");
    let (code, out) = lp.blkid();
    assert_eq!(code, Some(0));
    assert!(out.contains("TYPE=ext4"), "{out}");
    fs_err::write(mp.join("keep.txt"), "data").unwrap();

    // Prepare again while mounted: returned as is.
    let again = m.prepare(&lp.spec(true)).await.unwrap();
    assert_eq!(again, vol);

    release(&m, &vol).await;
    release(&m, &vol).await; // idempotent

    // Mounted again: the data is there, so it was not formatted a second time.
    let vol = m.prepare(&lp.spec(true)).await.unwrap();
    assert_eq!(fs_err::read_to_string(mp.join("keep.txt")).unwrap(), "data");
    release(&m, &vol).await;
}

/// What someone else mounted at a volume's path (an operator's mount, a stale mount of an
/// earlier volume of that name) is not the volume: its prepare refuses, saying so, and its
/// release leaves that mount alone. It used to be taken for the volume already mounted: the
/// task ran on another disk, and its release unmounted that disk.
#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn another_file_system_at_a_volumes_path_is_not_the_volume() {
    let (lp, m) = Loop::blank_managed(64);
    let other = Loop::blank(64);
    run("mkfs.ext4", &["-q", "-F", other.dev_str()]);
    let mp = lp.mount_point();
    fs_err::create_dir_all(&mp).unwrap();
    run("mount", &[other.dev_str(), mp.to_str().unwrap()]);
    let e = m.prepare(&lp.spec(true)).await.unwrap_err();
    assert!(
        matches!(e, ResourcesError::MountedElsewhere { .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("holds another file system"), "{e}");
    let vol = MountedVolume {
        name: "data".into(),
        mount_point: mp.to_string_lossy().into_owned(),
        device: lp.by_id("google-test-disk").to_string_lossy().into_owned(),
    };
    m.release(&vol).await.unwrap();
    assert!(is_mounted(&mp), "the other mount is left alone");
    run("umount", &[mp.to_str().unwrap()]);
    // A file system whose source is no device path (a tmpfs; NFS's `host:/export` alike).
    run("mount", &["-t", "tmpfs", "tmpfs", mp.to_str().unwrap()]);
    let e = m.prepare(&lp.spec(true)).await.unwrap_err();
    assert!(
        matches!(e, ResourcesError::MountedElsewhere { .. }),
        "{e:?}"
    );
    m.release(&vol).await.unwrap();
    assert!(is_mounted(&mp), "the tmpfs is left alone");
    run("umount", &[mp.to_str().unwrap()]);

    // Its own file system, mounted here, is the volume: prepared again as is, and released.
    let vol = m.prepare(&lp.spec(true)).await.unwrap();
    assert_eq!(m.prepare(&lp.spec(true)).await.unwrap(), vol);
    release(&m, &vol).await;
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn existing_filesystem_is_never_formatted_nor_chmodded() {
    let lp = Loop::blank(64);
    run("mkfs.ext4", &["-q", "-F", lp.dev_str()]);
    // Put a file on it and make its root 0755, as a user-formatted volume would be.
    let scratch = lp.tmp.path().join("scratch");
    fs_err::create_dir(&scratch).unwrap();
    run("mount", &[lp.dev_str(), scratch.to_str().unwrap()]);
    fs_err::write(scratch.join("user-data"), "precious").unwrap();
    fs_err::set_permissions(&scratch, std::fs::Permissions::from_mode(0o755)).unwrap();
    run("umount", &[scratch.to_str().unwrap()]);

    let m = lp.manager();
    let vol = m.prepare(&lp.spec(true)).await.unwrap();
    let mp = lp.mount_point();
    let user_data = fs_err::read_to_string(mp.join("user-data")).unwrap();
    assert_eq!(user_data, "precious");
    assert_mode_kept(&mp);
    release(&m, &vol).await;
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn blank_device_without_init_fs_is_an_error_and_stays_blank() {
    let (lp, m) = Loop::blank_managed(32);
    let e = m.prepare(&lp.spec(false)).await.unwrap_err();
    assert!(matches!(e, ResourcesError::NoFilesystem { .. }), "{e}");
    assert!(e.to_string().contains("init_fs"), "{e}");
    assert_eq!(lp.blkid().0, Some(2), "still blank");
    assert!(!is_mounted(&lp.mount_point()));
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn partitioned_device_is_never_formatted() {
    // An MBR with one Linux partition, written before attaching; only the disk is linked
    // (no `-part1` link), so the disk itself is what the volume names.
    let lp = Loop::new(32, write_mbr, &[]);
    let m = lp.manager();
    let table = Probe::Other("partition table dos".to_owned());
    assert_eq!(m.probe(&lp.dev).await.unwrap(), table);
    let e = m.prepare(&lp.spec(true)).await.unwrap_err();
    assert!(matches!(e, ResourcesError::NotAFilesystem { .. }), "{e}");
    let (code, out) = lp.blkid();
    assert_eq!(code, Some(0));
    assert!(out.contains("PTTYPE=dos"), "{out}");
    assert!(!out.contains("TYPE=ext4"), "{out}");
}

/// A partitioned GCP disk is used by its first partition (upstream prefers
/// `google-<name>-part1`): mounted as it is when the partition has a file system, the
/// partition table untouched; a partition without one is refused, `init_fs` or not, as
/// upstream refuses it (`blkid -p` finds the partition entry but no file system: upstream's
/// "non-filesystem signature", never formatted).
///
/// upstream: runner/internal/shim/backends/gcp.go (GetRealDeviceName),
/// runner/internal/shim/volumes.go (probeFilesystem).
#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn partitioned_gcp_disk_is_mounted_by_its_first_partition() {
    let (lp, part) = Loop::partitioned();
    let m = lp.manager();
    let part1 = lp.by_id("google-test-disk-part1");
    assert_eq!(m.find_device(&lp.spec(true)).await.unwrap(), part1);
    let part_blkid = || run("blkid", &["-p", "-o", "export", part.to_str().unwrap()]);
    let mp = lp.mount_point();

    // A partition without a file system: refused, not formatted.
    let no_fs = Probe::Other("a partition (dos) without a file system".to_owned());
    assert_eq!(m.probe(&part1).await.unwrap(), no_fs);
    let e = m.prepare(&lp.spec(true)).await.unwrap_err();
    assert!(matches!(e, ResourcesError::NotAFilesystem { .. }), "{e}");
    assert!(!part_blkid().contains("TYPE=ext4"), "not formatted");
    assert!(!is_mounted(&mp));

    // The partition formatted by its owner: mounted as it is, its mode kept.
    run("mkfs.ext4", &["-q", part.to_str().unwrap()]);
    let mounted = m.prepare(&lp.spec(true)).await.unwrap();
    assert_eq!(Path::new(&mounted.device), part1);
    assert!(is_mounted(&mp));
    assert_mode_kept(&mp);
    fs_err::write(mp.join("kept"), "data").unwrap();
    release(&m, &mounted).await;
    let (code, disk_blkid) = lp.blkid();
    assert_eq!(code, Some(0));
    let msg = format!("the table stays: {disk_blkid}");
    assert!(disk_blkid.contains("PTTYPE=dos"), "{msg}");

    let again = m.prepare(&lp.spec(false)).await.unwrap();
    assert_eq!(fs_err::read_to_string(mp.join("kept")).unwrap(), "data");
    release(&m, &again).await;
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn busy_mount_fails_release_until_freed() {
    let (lp, m) = Loop::blank_managed(32);
    let vol = m.prepare(&lp.spec(true)).await.unwrap();
    let mp = lp.mount_point();
    let open = fs_err::File::create(mp.join("open-file")).unwrap();
    let e = m.release(&vol).await.unwrap_err();
    assert!(matches!(e, ResourcesError::Unmount { .. }), "{e}");
    assert!(is_mounted(&mp));
    drop(open);
    release(&m, &vol).await;
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn aws_fallback_resolves_a_real_device_with_real_lsblk() {
    let (lp, m) = Loop::blank_managed(32);
    let spec = VolumeSpec {
        backend: VolumeBackend::Aws,
        volume_id: "vol-0123456789abcdef0".to_owned(),
        device_name: lp.dev_str().to_owned(),
        ..lp.spec(true)
    };
    assert_eq!(m.resolve_device(&spec).await.unwrap(), lp.dev);
    let vol = m.prepare(&spec).await.unwrap();
    assert_eq!(vol.device, lp.dev_str());
    release(&m, &vol).await;
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn zero_size_device_is_refused() {
    let (lp, m) = Loop::blank_managed(0);
    let e = m.resolve_device(&lp.spec(true)).await.unwrap_err();
    assert!(e.to_string().contains("size is zero"), "{e}");
    let e = m.prepare(&lp.spec(true)).await.unwrap_err();
    assert!(matches!(e, ResourcesError::NotBlockDevice { .. }), "{e}");
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn release_of_recovered_volume_without_device() {
    let (lp, m) = Loop::blank_managed(32);
    let vol = m.prepare(&lp.spec(true)).await.unwrap();
    // What the engine builds from an old container's mounts: no device known.
    let recovered = MountedVolume {
        device: String::new(),
        ..vol
    };
    release(&m, &recovered).await;
}

/// Delegates to the system runner and counts `mkfs.ext4` runs.
#[derive(Default)]
struct CountingRunner {
    inner: SystemCommandRunner,
    mkfs: AtomicUsize,
}

impl CountingRunner {
    fn mkfs_runs(&self) -> usize {
        self.mkfs.load(Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl CommandRunner for CountingRunner {
    async fn run(
        &self,
        command: &shim_util::Command,
    ) -> Result<shim_util::CommandOutput, shim_util::CommandError> {
        if command.get_program() == Path::new("mkfs.ext4") {
            self.mkfs.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.run(command).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn concurrent_prepares_of_one_blank_volume_format_it_once() {
    let lp = Loop::blank(64);
    let runner = Arc::new(CountingRunner::default());
    let m = Arc::new(lp.manager_with(runner.clone()));
    let vols = prepare_all(&m, &vec![lp.spec(true); 4]).await;
    assert_eq!(runner.mkfs_runs(), 1);
    assert!(vols.windows(2).all(|w| w[0] == w[1]));
    // Mounted once, not stacked four times.
    let table = fs_err::read_to_string("/proc/self/mountinfo").unwrap();
    let mp = lp.mount_point();
    let count = table
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(mp.to_str().unwrap()))
        .count();
    assert_eq!(count, 1, "{table}");
    release(&m, &vols[0]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn two_volumes_prepare_and_release_in_parallel() {
    // Locks are per mount point and per device: two blank volumes are formatted, mounted and
    // unmounted side by side by one manager, each exactly once.
    let a = Loop::blank(32);
    let b = Loop::blank(32);
    symlink(&b.dev, a.by_id("google-other-disk")).unwrap();
    let runner = Arc::new(CountingRunner::default());
    let m = Arc::new(a.manager_with(runner.clone()));
    let specs = [a.spec(true), gcp_spec("other", "other-disk", true)];
    let vols = prepare_all(&m, &specs).await;
    assert_eq!(runner.mkfs_runs(), 2);
    assert_eq!(Path::new(&vols[1].device), a.by_id("google-other-disk"));
    for v in &vols {
        assert!(is_mounted(Path::new(&v.mount_point)), "{v:?}");
    }
    release_all(&m, &vols).await;
    for v in &vols {
        assert!(!is_mounted(Path::new(&v.mount_point)), "{v:?}");
    }
    assert_eq!(b.blkid().0, Some(0), "formatted");
}
