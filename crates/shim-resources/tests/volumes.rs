//! Volume resolution, probing and mount-table parsing with recorded tool outputs (no root).
//! The real-device tests are in `loop_volumes.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shim_resources::volumes::{
    Probe, aws_fallback_names, find_aws_device, is_mount_point_in, parse_blkid,
};
use shim_resources::{BlockVolumes, ResourcesError, VolumeConfig, VolumeManager};
use shim_task::{MountedVolume, TaskName, VolumeBackend, VolumeSpec};
use shim_util::CommandOutput;
use shim_util::fake::ScriptedCommandRunner;

fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/lsblk")
        .join(name);
    fs_err::read_to_string(p).unwrap()
}

fn aws(volume_id: &str, device_name: &str) -> VolumeSpec {
    VolumeSpec {
        backend: VolumeBackend::Aws,
        name: TaskName::new("data").unwrap(),
        volume_id: volume_id.to_owned(),
        init_fs: true,
        device_name: device_name.to_owned(),
    }
}

/// A manager of the devices under a temporary dir, and the runner that scripts its tools.
fn manager() -> (tempfile::TempDir, Arc<ScriptedCommandRunner>, BlockVolumes) {
    let dev_dir = tempfile::tempdir().unwrap();
    let runner = Arc::new(ScriptedCommandRunner::new());
    let mut config = VolumeConfig::with_root("/nonexistent/volumes").fast();
    config.dev_dir = dev_dir.path().to_owned();
    config.gcp_by_id_dir = dev_dir.path().join("disk/by-id");
    (dev_dir, runner.clone(), BlockVolumes::new(config, runner))
}

/// A GCP volume spec on the disk GCP calls `device_name`.
fn gcp(device_name: &str) -> VolumeSpec {
    VolumeSpec {
        backend: VolumeBackend::Gcp,
        device_name: device_name.to_owned(),
        ..aws("", "")
    }
}

#[test]
fn aws_serial_matching_and_partitions() {
    let nitro = fixture("nitro.json");
    let find = |id: &str| find_aws_device(&nitro, id, &[]).unwrap();
    // Unpartitioned: the disk itself.
    assert_eq!(find("vol-0123456789abcdef0").as_deref(), Some("nvme1n1"));
    // Partitioned: the first partition.
    assert_eq!(find("vol-0fedcba9876543210").as_deref(), Some("nvme2n1p1"));
    assert_eq!(find("vol-0a1b2c3d4e5f60718").as_deref(), Some("nvme0n1p1"));
    // Unknown id, and a serial that is not a volume id, match nothing.
    assert_eq!(find("vol-0000000000000000"), None);
    assert_eq!(find("AWS22D4E8F2A1B3C4D5E"), None);
    assert_eq!(find(""), None);
    assert!(find_aws_device("not json", "vol-1", &[]).is_err());
}

#[test]
fn aws_device_name_fallback() {
    assert_eq!(aws_fallback_names("/dev/sdf"), vec!["sdf", "xvdf"]);
    assert_eq!(aws_fallback_names("/dev/xvdg"), vec!["xvdg"]);
    assert!(aws_fallback_names("sdf").is_empty());
    assert!(aws_fallback_names("/dev/../etc").is_empty());
    assert!(aws_fallback_names("/dev/").is_empty());
    let xen = fixture("xen.json");
    let find = |id: &str, dev: &str| find_aws_device(&xen, id, &aws_fallback_names(dev)).unwrap();
    assert_eq!(find("vol-0123", "/dev/sdf").as_deref(), Some("xvdf"));
    // The first partition of the fallback device.
    assert_eq!(find("vol-0123", "/dev/sdg").as_deref(), Some("xvdg1"));
    assert_eq!(find("", "/dev/sdz"), None);
}

#[tokio::test]
async fn aws_device_appearing_late_is_polled_for() {
    let (tmp, runner, m) = manager();
    runner.push("lsblk", CommandOutput::ok(fixture("empty.json")));
    runner.push("lsblk", CommandOutput::ok(fixture("empty.json")));
    runner.always("lsblk", CommandOutput::ok(fixture("nitro.json")));
    let spec = aws("vol-0123456789abcdef0", "/dev/sdf");
    let dev = m.find_device(&spec).await.unwrap();
    assert_eq!(dev, tmp.path().join("nvme1n1"));
    assert_eq!(runner.count("lsblk"), 3);
    assert_eq!(runner.calls()[0][1..], ["-J", "-o", "NAME,SERIAL,TYPE"]);
}

#[tokio::test]
async fn aws_device_never_appearing_is_an_error_after_the_wait() {
    let (_tmp, runner, m) = manager();
    runner.always("lsblk", CommandOutput::ok(fixture("empty.json")));
    let spec = aws("vol-0123456789abcdef0", "/dev/sdf");
    let e = m.find_device(&spec).await.unwrap_err();
    assert!(matches!(e, ResourcesError::DeviceNotFound { .. }), "{e}");
    assert!(runner.count("lsblk") >= 2, "polled");
}

#[tokio::test]
async fn aws_fallback_device_node_not_in_lsblk() {
    let (tmp, runner, m) = manager();
    fs_err::write(tmp.path().join("xvdf"), "").unwrap();
    runner.always("lsblk", CommandOutput::ok(fixture("empty.json")));
    let dev = m.find_device(&aws("vol-1", "/dev/sdf")).await.unwrap();
    assert_eq!(dev, tmp.path().join("xvdf"));
}

#[tokio::test]
async fn gcp_uses_the_by_id_path() {
    let (tmp, runner, m) = manager();
    let by_id = tmp.path().join("disk/by-id/google-pd-data");
    assert_eq!(m.find_device(&gcp("pd-data")).await.unwrap(), by_id);
    assert!(runner.calls().is_empty());
    assert!(m.find_device(&gcp("../sda")).await.is_err());
}

/// A partitioned GCP disk is used by its first partition, as upstream resolves it: the
/// `google-<name>-part1` link when it exists (also when it is the only one), else the disk.
///
/// upstream: runner/internal/shim/backends/gcp.go (GetRealDeviceName).
#[tokio::test]
async fn gcp_prefers_the_first_partition() {
    let (tmp, runner, m) = manager();
    let by_id = tmp.path().join("disk/by-id");
    fs_err::create_dir_all(&by_id).unwrap();
    for (target, link) in [
        ("sdb", "google-pd-data"),
        ("sdb1", "google-pd-data-part1"),
        ("sdc", "google-pd-whole"),
        ("sdd1", "google-pd-late-part1"),
    ] {
        symlink(format!("../../{target}"), by_id.join(link)).unwrap();
    }
    for (name, found) in [
        ("pd-data", "google-pd-data-part1"),
        ("pd-whole", "google-pd-whole"),
        // A partition link alone (its target not there yet) is still the partition.
        ("pd-late", "google-pd-late-part1"),
    ] {
        let got = m.find_device(&gcp(name)).await.unwrap();
        assert_eq!(got, by_id.join(found), "{name}");
    }
    assert!(runner.calls().is_empty());
}

#[tokio::test]
async fn missing_or_non_block_device_is_an_error_after_a_bounded_wait() {
    let (tmp, _, m) = manager();
    let missing = tmp.path().join("missing");
    let e = m.wait_block_device(&missing).await.unwrap_err();
    assert!(matches!(e, ResourcesError::NotBlockDevice { .. }), "{e}");
    let file = tmp.path().join("regular");
    fs_err::write(&file, "data").unwrap();
    // A character device is not a block device either.
    for dev in [file.as_path(), Path::new("/dev/null")] {
        let e = m.wait_block_device(dev).await.unwrap_err();
        assert!(e.to_string().contains("not a block device"), "{e}");
    }
}

#[test]
fn blkid_output() {
    let other = |what: &str| Some(Probe::Other(what.to_owned()));
    assert_eq!(parse_blkid(Some(2), ""), Some(Probe::Blank));
    let ext4 = "DEVNAME=/dev/loop0\nUUID=ab\nBLOCK_SIZE=4096\nTYPE=ext4\nUSAGE=filesystem\n";
    let ext4_fs = Some(Probe::Filesystem("ext4".to_owned()));
    assert_eq!(parse_blkid(Some(0), ext4), ext4_fs);
    let table = "DEVNAME=/dev/loop0\nPTTYPE=dos\n";
    assert_eq!(parse_blkid(Some(0), table), other("partition table dos"));
    // A partition that holds nothing (blkid 2.38 exits 0 with its table entry): never blank.
    let empty = "DEVNAME=/dev/loop0p1\nPART_ENTRY_SCHEME=dos\nPART_ENTRY_TYPE=0x83\n\
                 PART_ENTRY_NUMBER=1\nPART_ENTRY_OFFSET=2048\nPART_ENTRY_SIZE=63488\n";
    let no_fs = other("a partition (dos) without a file system");
    assert_eq!(parse_blkid(Some(0), empty), no_fs);
    let luks = "TYPE=crypto_LUKS\nUSAGE=crypto\n";
    assert_eq!(parse_blkid(Some(0), luks), other("crypto_LUKS (crypto)"));
    assert_eq!(parse_blkid(Some(4), ""), None);
    assert_eq!(parse_blkid(None, ""), None);
}

#[tokio::test]
async fn blank_must_be_confirmed_before_it_is_believed() {
    let (_tmp, runner, m) = manager();
    let dev = PathBuf::from("/dev/fake");
    // A file system shows up on the third probe: not blank.
    runner.push("blkid", CommandOutput::exit(2, ""));
    runner.push("blkid", CommandOutput::exit(2, ""));
    runner.push("blkid", CommandOutput::ok("TYPE=xfs\nUSAGE=filesystem\n"));
    let xfs = Probe::Filesystem("xfs".to_owned());
    assert_eq!(m.probe_confirmed(&dev).await.unwrap(), xfs);
    // Blank every time: one probe plus three confirmations.
    let (_tmp, runner, m) = manager();
    runner.always("blkid", CommandOutput::exit(2, ""));
    assert_eq!(m.probe_confirmed(&dev).await.unwrap(), Probe::Blank);
    assert_eq!(runner.count("blkid"), 4);
    assert_eq!(runner.calls()[0][1..], ["-p", "-o", "export", "/dev/fake"]);
    // A probe failure is an error, not "blank".
    let (_tmp, runner, m) = manager();
    runner.push("blkid", CommandOutput::exit(2, ""));
    runner.push("blkid", CommandOutput::exit(8, "ambivalent result"));
    assert!(m.probe_confirmed(&dev).await.is_err());
}

#[test]
fn mount_points_from_mountinfo() {
    let table = "22 1 8:1 / / rw,relatime - ext4 /dev/vda1 rw\n\
                 43 22 7:0 / /mnt/disks/dstack-volumes/data rw,relatime - ext4 /dev/loop0 rw\n\
                 44 22 7:1 / /mnt/with\\040space rw - ext4 /dev/loop1 rw\n";
    for (path, mounted) in [
        ("/mnt/disks/dstack-volumes/data", true),
        ("/mnt/with space", true),
        ("/mnt/disks/dstack-volumes", false),
        ("/mnt/with\\040space", false),
    ] {
        assert_eq!(is_mount_point_in(table, Path::new(path)), mounted, "{path}");
    }
    // Byte for byte: a name that is not UTF-8 is found as it is; a backslash not followed by
    // three octal digits is kept.
    let odd = "45 22 7:2 / /mnt/\\377x rw - ext4 /dev/loop2 rw\n\
               46 22 7:3 / /mnt/a\\09 rw - ext4 /dev/loop3 rw\n";
    let points: Vec<PathBuf> = shim_resources::volumes::mount_points(odd).collect();
    let not_utf8 = PathBuf::from(std::ffi::OsStr::from_bytes(b"/mnt/\xffx"));
    assert_eq!(points, [not_utf8, PathBuf::from("/mnt/a\\09")]);

    // What is mounted at a path: the topmost mount there (the table's last line for it), its
    // device number and its source (optional fields before the separator skipped).
    let stacked = "43 22 7:0 / /mnt/v rw shared:5 - ext4 /dev/loop0 rw\n\
                   47 43 0:52 / /mnt/v rw - btrfs /dev/with\\040space rw\n";
    let top = shim_resources::volumes::mount_at(stacked, Path::new("/mnt/v"));
    assert_eq!(top, Some(((0, 52), PathBuf::from("/dev/with space"))));
    let root = shim_resources::volumes::mount_at(table, Path::new("/"));
    assert_eq!(root, Some(((8, 1), PathBuf::from("/dev/vda1"))));
    assert_eq!(
        shim_resources::volumes::mount_at(table, Path::new("/mnt")),
        None
    );
}

/// The kernel lists a mount point by its resolved path: one reached through a symbolic link
/// (a volumes root under a linked `/mnt`) is still seen mounted, so a release unmounts it and
/// a prepare does not mount it again on top.
#[test]
fn a_mount_point_through_a_link_is_seen_mounted() {
    use shim_resources::volumes::{Mounter as _, SystemMounter};
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real");
    fs_err::create_dir_all(real.join("data")).unwrap();
    symlink(&real, tmp.path().join("link")).unwrap();
    let resolved = fs_err::canonicalize(real.join("data")).unwrap();
    let mountinfo = tmp.path().join("mountinfo");
    let line = format!(
        "43 22 7:0 / {} rw - ext4 /dev/loop0 rw\n",
        resolved.display()
    );
    fs_err::write(&mountinfo, line).unwrap();
    let mounter = SystemMounter::new(&mountinfo);
    assert!(mounter.is_mounted(&tmp.path().join("link/data")).unwrap());
    assert!(mounter.is_mounted(&real.join("data")).unwrap());
    assert!(!mounter.is_mounted(&tmp.path().join("link")).unwrap());
    assert!(!mounter.is_mounted(&tmp.path().join("link/gone")).unwrap());
}

#[tokio::test]
async fn release_outside_root_or_not_mounted_is_a_no_op() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = VolumeConfig::with_root(tmp.path().join("volumes")).fast();
    let mountinfo = tmp.path().join("mountinfo");
    fs_err::write(
        &mountinfo,
        "22 1 8:1 / / rw - ext4 /dev/vda1 rw\n30 22 0:5 / /proc rw - proc proc rw\n",
    )
    .unwrap();
    config.mountinfo = mountinfo;
    let m = BlockVolumes::new(config, Arc::new(ScriptedCommandRunner::new()));
    let under = |rel: &str| tmp.path().join(rel).to_string_lossy().into_owned();
    for mp in [
        "/proc".to_owned(),
        "/".to_owned(),
        under("volumes"),
        under("volumes/../../x"),
        under("volumes/data"),
    ] {
        let v = MountedVolume {
            name: "data".to_owned(),
            mount_point: mp,
            device: String::new(),
        };
        m.release(&v).await.unwrap();
    }
    assert_eq!(m.mount_point("data"), tmp.path().join("volumes/data"));
}
