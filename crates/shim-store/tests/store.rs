//! The store against a real filesystem: layout, round trips, quarantine, credentials, delete.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{
    all_files, create_with_record, id, json, mode, names, record, stored_form, temp_store,
};
use proptest::prelude::*;
use proptest::sample::select;
use shim_store::{RecordError, ScanEntry, Store, StoreError};
use shim_task::{
    GpuDevice, HostKeysGrant, InstanceMountPoint, MountedVolume, NetworkMode, PublicKey, Resources,
    Secret, TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus, TerminationReason, VolumeBackend,
    VolumeMountPoint, VolumeSpec,
};

#[test]
fn store_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Store>();
    check::<StoreError>();
}

#[test]
fn layout_and_modes() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path().join("home")).unwrap();
    let tasks = home.path().join("home/runners");
    assert_eq!(store.runners_dir(), tasks);
    assert_eq!(mode(&tasks), 0o755);
    assert_eq!(mode(&home.path().join("home")), 0o700);

    let r = record("t1");
    let p = store.create_task_dir(&r.container_name).unwrap();
    assert_eq!(p.dir, tasks.join("job-t1"));
    assert_eq!(p.state_file, tasks.join("job-t1/task.json"));
    assert_eq!(p.pull_log, tasks.join("job-t1/pull.log"));
    assert_eq!(p.runner_dir, tasks.join("job-t1/runner"));
    assert_eq!(store.paths(&r.container_name).unwrap(), p);
    assert_eq!(mode(&p.dir), 0o700);
    assert_eq!(mode(&p.runner_dir), 0o755);
    assert!(!p.state_file.exists(), "no record before the first write");

    store.write(&r).unwrap();
    assert_eq!(mode(&p.state_file), 0o600);
    let json = json(&p.state_file);
    // Upstream's format version 1, this shim's records in their own field.
    assert_eq!(json["version"], 1);
    assert_eq!(json["id"], "t1");
    assert_eq!(json["config"]["id"], "t1");
    assert_eq!(json["termination_reason"], "");
    assert_eq!(json["cleaned_up"], false);
    assert_eq!(json["rust_shim"]["container_name"], "job-t1");
    assert_eq!(json["rust_shim"]["status"], "pending");
    assert_eq!(names(&p.dir), ["runner", "task.json"]);
}

#[test]
fn create_task_dir_refuses_a_taken_id_and_reuses_an_empty_dir() {
    let (_home, store) = temp_store();
    let r = record("t1");
    store.create_task_dir(&r.container_name).unwrap();
    // No record yet (a submit cut short before its first write): the directory is reused.
    store.create_task_dir(&r.container_name).unwrap();
    store.write(&r).unwrap();
    let err = store.create_task_dir(&r.container_name).unwrap_err();
    assert!(matches!(err, StoreError::TaskExists { .. }), "{err:?}");
    let stored = store.read(&r.container_name).unwrap().unwrap();
    assert_eq!(stored, r, "the record is untouched");
}

#[test]
fn read_and_write_without_a_directory() {
    let (_home, store) = temp_store();
    let r = record("t1");
    assert!(store.read(&r.container_name).unwrap().is_none());
    let err = store.write(&r).unwrap_err();
    assert!(matches!(err, StoreError::NoTaskDir { .. }), "{err:?}");
    let dir = store.paths(&r.container_name).unwrap().dir;
    assert!(!dir.exists(), "write never creates the dir");
}

#[test]
fn a_task_directory_that_is_a_link_is_never_used() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path().join("home")).unwrap();
    let r = record("t1");
    let elsewhere = home.path().join("elsewhere");
    fs_err::create_dir(&elsewhere).unwrap();
    let dir = store.paths(&r.container_name).unwrap().dir;
    std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();

    let err = store.write(&r).unwrap_err();
    assert!(matches!(err, StoreError::UnsafePath { .. }), "{err:?}");
    let err = store.create_task_dir(&r.container_name).unwrap_err();
    assert!(matches!(err, StoreError::UnsafePath { .. }), "{err:?}");
    assert!(store.read(&r.container_name).is_err());
    assert!(!store.remove_skeleton(&r.container_name).unwrap());
    let through = names(&elsewhere);
    assert!(through.is_empty(), "written through the link: {through:?}");
    // The scan does not follow it either.
    assert!(store.scan().unwrap().is_empty());
}

#[test]
fn rewrite_replaces_the_record() {
    let (home, store) = temp_store();
    let mut r = record("t1");
    let p = store.create_task_dir(&r.container_name).unwrap();
    use TaskStatus::{Pending, Preparing, Running};
    for status in [Pending, Preparing, Running] {
        r.status = status;
        store.write(&r).unwrap();
        assert_eq!(store.read(&r.container_name).unwrap().unwrap(), r);
    }
    assert_eq!(names(&p.dir), ["runner", "task.json"]);
    // A reopened store (a restarted shim) sees the last record.
    let again = Store::open(home.path()).unwrap();
    let entries = again.scan().unwrap();
    assert!(matches!(&entries[..], [ScanEntry::Record { record: got, .. }] if *got == r));
}

/// A secret that must never appear on disk.
const PASSWORD: &str = "hunter2-never-on-disk";

#[test]
fn registry_password_never_reaches_the_disk() {
    let (home, store) = temp_store();
    let mut config = TaskConfig::new(id("t1"), TaskName::new("job").unwrap(), "img:1");
    config.registry_username = "shimtest".into();
    config.registry_password = Secret::new(PASSWORD);

    // The normal path: TaskRecord::new strips credentials.
    create_with_record(&store, &TaskRecord::new(&config, "job-1".into(), 1));

    // A careless caller passing the full config: the store strips them itself.
    let mut config2 = config.clone();
    config2.id = id("t2");
    let mut careless = TaskRecord::new(&config2, "job-2".into(), 1);
    careless.config = Some(Arc::new(config2.clone()));
    let careless_config = careless.config.as_ref().unwrap();
    assert_eq!(careless_config.registry_password.expose(), PASSWORD);
    create_with_record(&store, &careless);
    careless.status = TaskStatus::Running;
    store.write(&careless).unwrap();

    let back = store.read(&careless.container_name).unwrap().unwrap();
    let stored = back.config.unwrap();
    assert!(stored.registry_password.is_empty());
    assert!(stored.registry_username.is_empty());
    assert_eq!(*stored, config2.without_credentials());

    // Through a scan (which may move files around) too.
    store.scan().unwrap();
    let files = all_files(home.path());
    assert!(files.len() >= 2, "{files:?}");
    for f in files {
        let bytes = fs_err::read(&f).unwrap();
        let (text, f) = (String::from_utf8_lossy(&bytes), f.display());
        assert!(!text.contains(PASSWORD), "{f} holds the password");
        assert!(!text.contains("shimtest"), "{f} holds the user");
    }
}

/// Writes raw bytes as task `name`'s state file.
fn plant(store: &Store, name: &str, bytes: &[u8]) -> PathBuf {
    let p = store.create_task_dir(name).unwrap();
    fs_err::write(&p.state_file, bytes).unwrap();
    p.state_file
}

#[test]
fn unusable_state_files_are_moved_aside_and_the_scan_goes_on() {
    let (_home, store) = temp_store();

    let good = record("good");
    let good_file = create_with_record(&store, &good).state_file;
    let good_bytes = fs_err::read(&good_file).unwrap();
    let text = String::from_utf8(good_bytes.clone()).unwrap();
    let edited = |from: &str, to: &str| text.replace(from, to).into_bytes();
    let half = &good_bytes[..good_bytes.len() / 2];

    const INVALID: &str = "not a valid task record";
    const UNKNOWN: &str = "unknown schema version 0";
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "empty"),
        ("blank", b"  \n".to_vec(), "empty"),
        ("truncated", half.to_vec(), INVALID),
        ("garbage", vec![0xff, 0x00, 0x13, 0x37, b'{'], INVALID),
        ("other-json", br#"{"a": 1}"#.to_vec(), UNKNOWN),
        ("no-task", br#"{"version": 1}"#.to_vec(), INVALID),
        (
            "newer",
            edited("\"version\": 1", "\"version\": 2"),
            "written by a newer shim (schema 2)",
        ),
        (
            "newer-extension",
            edited("\"schema\": 1", "\"schema\": 7"),
            "written by a newer shim (schema 7)",
        ),
        ("zero", edited("\"version\": 1", "\"version\": 0"), UNKNOWN),
        (
            "wrong-task",
            good_bytes.clone(),
            "the record is for task good, not for directory wrong-task",
        ),
    ];
    for (name, bytes, _) in &cases {
        plant(&store, name, bytes);
    }
    // task.json as a directory, and as a symlink to a valid record elsewhere.
    let p = store.create_task_dir("a-dir").unwrap();
    fs_err::create_dir(&p.state_file).unwrap();
    let p = store.create_task_dir("a-link").unwrap();
    std::os::unix::fs::symlink(&good_file, &p.state_file).unwrap();

    // read() reports, and leaves the file where it is.
    let err = store.read("newer").unwrap_err();
    assert!(matches!(
        err,
        StoreError::Unreadable {
            source: RecordError::NewerSchema(2),
            ..
        }
    ));
    assert!(store.paths("newer").unwrap().state_file.exists());

    let entries = store.scan().unwrap();
    assert_eq!(entries.len(), cases.len() + 3, "{entries:#?}");
    let mut corrupt = 0;
    for e in &entries {
        match e {
            ScanEntry::Record { record: r, .. } => assert_eq!(*r, good),
            ScanEntry::NoRecord { dir, .. } | ScanEntry::MountedWhole { dir, .. } => {
                panic!("unexpected entry {}", dir.display())
            }
            ScanEntry::Corrupt {
                name: id,
                dir,
                moved_to,
                error,
            } => {
                corrupt += 1;
                let moved = moved_to.as_ref().expect("moved aside");
                assert_eq!(moved.parent(), Some(dir.as_path()));
                let file = moved.file_name().unwrap().to_str().unwrap();
                let ms = file.strip_prefix("task.json.corrupt-").unwrap();
                assert!(ms.parse::<u64>().unwrap() > 1_600_000_000_000, "{file}");
                assert!(!dir.join("task.json").exists(), "{id}: still task.json");
                let msg = error.to_string();
                match cases.iter().find(|c| c.0 == id) {
                    Some((_, bytes, expect)) => {
                        assert!(msg.contains(expect), "{id}: {msg:?} lacks {expect:?}");
                        assert_eq!(fs_err::read(moved).unwrap(), *bytes, "{id}: kept as is");
                    }
                    None => {
                        assert!(matches!(error, RecordError::NotAFile), "{id}: {error:?}");
                    }
                }
            }
        }
    }
    assert_eq!(corrupt, cases.len() + 2);
    // The symlink's target was not touched.
    assert_eq!(store.read(&good.container_name).unwrap().unwrap(), good);

    // Next start: those tasks have no record any more; nothing is moved twice.
    let entries = store.scan().unwrap();
    let no_record = entries
        .iter()
        .filter(|e| matches!(e, ScanEntry::NoRecord { .. }));
    assert_eq!(no_record.count(), cases.len() + 2);
}

/// A state file that only could not be read (an I/O error: a bad sector, a full file table)
/// is not corrupt: it stays in place, reported as unusable this time, and reads at the next
/// start. It used to be moved aside like garbage, and with it the task's volumes and keys
/// were forgotten for good.
#[test]
fn a_state_file_that_cannot_be_read_now_stays_for_the_next_start() {
    let home = tempfile::tempdir().unwrap();
    let faults = Arc::new(shim_fs::fault::Faults::new());
    let store = Store::open(home.path().join("home"))
        .unwrap()
        .with_faults(faults.clone());
    let r = record("t1");
    store.create(&r).unwrap();
    faults.arm(shim_fs::Step::Read, shim_fs::fault::FaultKind::Fail);
    let entries = store.scan().unwrap();
    let [
        ScanEntry::Corrupt {
            moved_to, error, ..
        },
    ] = entries.as_slice()
    else {
        panic!("{entries:#?}");
    };
    assert!(matches!(error, RecordError::Io(_)), "{error:?}");
    assert_eq!(*moved_to, None, "left in place");
    assert_eq!(
        names(&store.paths("job-t1").unwrap().dir),
        ["runner", "task.json"]
    );

    let entries = store.scan().unwrap();
    let [ScanEntry::Record { record, .. }] = entries.as_slice() else {
        panic!("{entries:#?}");
    };
    assert_eq!(*record, r);
}

#[test]
fn foreign_directories_are_reported_and_never_touched() {
    let (_home, store) = temp_store();
    let tasks = store.runners_dir().to_owned();
    for d in ["lost+found", ".hidden", "no-record"] {
        fs_err::create_dir(tasks.join(d)).unwrap();
        fs_err::write(tasks.join(d).join("task.json.tmp"), b"x").unwrap();
    }
    // Garbage in a dir whose name is not a container name: not ours, not moved.
    fs_err::write(tasks.join("lost+found/task.json"), b"garbage").unwrap();
    fs_err::write(tasks.join("stray-file"), b"x").unwrap();
    std::os::unix::fs::symlink(tasks.join("no-record"), tasks.join("a-symlink")).unwrap();
    fs_err::create_dir(tasks.join(".trash-old-1")).unwrap();

    let entries = store.scan().unwrap();
    let mut dirs: Vec<String> = entries
        .iter()
        .map(|e| match e {
            ScanEntry::NoRecord { name, skeleton, .. } => {
                assert!(!skeleton, "{name} holds a file");
                name.clone()
            }
            other => panic!("{other:?}"),
        })
        .collect();
    dirs.sort();
    assert_eq!(dirs, ["no-record"]);
    let lost = tasks.join("lost+found");
    assert_eq!(names(&lost), ["task.json", "task.json.tmp"]);
    assert_eq!(fs_err::read(lost.join("task.json")).unwrap(), b"garbage");
    assert_eq!(names(&tasks.join("no-record")), ["task.json.tmp"]);
}

#[test]
fn delete_removes_the_task_and_unknown_is_ok() {
    let (home, store) = temp_store();
    let r = record("t1");
    let p = create_with_record(&store, &r);
    fs_err::write(&p.pull_log, b"{}").unwrap();
    fs_err::create_dir_all(p.runner_dir.join("a/b")).unwrap();
    fs_err::write(p.runner_dir.join("a/b/c"), b"x").unwrap();
    // A symlink out of the runner dir (the container can write those): not followed.
    let outside = home.path().join("outside");
    fs_err::create_dir(&outside).unwrap();
    fs_err::write(outside.join("keep"), b"x").unwrap();
    std::os::unix::fs::symlink(&outside, p.runner_dir.join("escape")).unwrap();

    store.delete(&r.container_name).unwrap();
    assert!(!p.dir.exists());
    assert!(outside.join("keep").exists());
    assert!(store.read(&r.container_name).unwrap().is_none());
    store.delete(&r.container_name).unwrap();
    store.delete("never-existed").unwrap();
    // Nothing is left behind, not even the trash.
    assert!(names(store.runners_dir()).is_empty());
    assert!(store.scan().unwrap().is_empty());
    // The id can be used again.
    store.create_task_dir(&r.container_name).unwrap();
}

/// A directory marked as mounted whole is reported as such, its state file neither read nor
/// moved aside (it is its container's); a delete removes the mark with the directory, and a
/// mark left without its directory is removed by the next scan.
#[test]
fn a_directory_marked_as_mounted_whole_is_never_read() {
    let (_home, store) = temp_store();
    let forged = plant(&store, "marked", b"{ not a record");
    store.mark_mounted_whole("marked").unwrap();
    store.mark_mounted_whole("marked").unwrap();
    let entries = store.scan().unwrap();
    let whole = matches!(&entries[..], [ScanEntry::MountedWhole { name, .. }] if name == "marked");
    assert!(whole, "{entries:?}");
    let left = fs_err::read(&forged).unwrap();
    assert_eq!(left, b"{ not a record", "left as it was");
    store.delete("marked").unwrap();
    assert!(names(store.runners_dir()).is_empty());
    // A delete cut between the directory and its mark.
    store.create_task_dir("gone").unwrap();
    store.mark_mounted_whole("gone").unwrap();
    fs_err::remove_dir_all(store.runners_dir().join("gone")).unwrap();
    assert!(store.scan().unwrap().is_empty());
    assert!(names(store.runners_dir()).is_empty());
    let bad_name = store.mark_mounted_whole("../x");
    assert!(bad_name.is_err(), "names are checked");
}

// --- round trip ---------------------------------------------------------------------------

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe";

fn id_str() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9][a-zA-Z0-9_.-]{0,40}"
}

fn task_name() -> impl Strategy<Value = TaskName> {
    id_str().prop_map(|s| TaskName::new(s).unwrap())
}

fn key() -> impl Strategy<Value = PublicKey> {
    proptest::option::of("[a-zA-Z0-9@._-]{1,12}( [a-z]{1,5})?").prop_map(|c| {
        PublicKey::parse(&match c {
            Some(c) => format!("{KEY} {c}"),
            None => KEY.to_owned(),
        })
        .unwrap()
    })
}

fn status() -> impl Strategy<Value = TaskStatus> {
    use TaskStatus::*;
    select(vec![
        Pending, Preparing, Pulling, Creating, Running, Terminated,
    ])
}

fn reason() -> impl Strategy<Value = TerminationReason> {
    use TerminationReason as R;
    prop_oneof![
        8 => select(vec![
            R::ExecutorError,
            R::CreatingContainerError,
            R::ContainerExitedWithError,
            R::DoneByRunner,
            R::TerminatedByUser,
            R::TerminatedByServer,
            R::MaxDurationExceeded,
            R::LogQuotaExceeded,
        ]),
        // Known strings parse to the known variants, so `Other` carries only unknown ones.
        1 => ".*".prop_map(|s| TerminationReason::parse(&s)),
    ]
}

/// Up to two of `s`.
fn few<S: Strategy>(s: S) -> impl Strategy<Value = Vec<S::Value>> {
    proptest::collection::vec(s, 0..3)
}

prop_compose! {
    fn volume()(
        aws in any::<bool>(),
        name in task_name(),
        volume_id in ".*",
        init_fs in any::<bool>(),
        device_name in ".*",
    ) -> VolumeSpec {
        let backend = if aws { VolumeBackend::Aws } else { VolumeBackend::Gcp };
        VolumeSpec { backend, name, volume_id, init_fs, device_name }
    }
}

prop_compose! {
    fn config(task: TaskId)(
        name in task_name(),
        image in ".*",
        user in ".*",
        password in ".*",
        container_user in ".*",
        privileged in any::<bool>(),
        gpu in any::<i64>(),
        // Decimal CPU counts as a server sends them. (Arbitrary f64 may come back one ULP
        // off: serde_json parses floats exactly only with its `float_roundtrip` feature.)
        cpu in (0u32..=1_000_000).prop_map(|n| f64::from(n) / 1000.0),
        memory in any::<i64>(),
        shm_size in any::<i64>(),
        bridge in any::<bool>(),
        volumes in few(volume()),
        volume_mounts in few((task_name(), ".*")),
        instance_mounts in few((".*", ".*")),
        gpu_devices in few((".*", ".*")),
        host_ssh_user in ".*",
        host_ssh_keys in few(key()),
        container_ssh_keys in few(key()),
    ) -> TaskConfig {
        let mut c = TaskConfig::new(task.clone(), name, image);
        c.registry_username = user;
        c.registry_password = Secret::new(password);
        c.container_user = container_user;
        c.privileged = privileged;
        c.gpu = gpu;
        c.cpu = cpu;
        c.memory = memory;
        c.shm_size = shm_size;
        c.network_mode = if bridge { NetworkMode::Bridge } else { NetworkMode::Host };
        c.volumes = volumes;
        c.volume_mounts = volume_mounts
            .into_iter()
            .map(|(name, path)| VolumeMountPoint { name, path })
            .collect();
        c.instance_mounts = instance_mounts
            .into_iter()
            .map(|(instance_path, path)| InstanceMountPoint { instance_path, path })
            .collect();
        c.gpu_devices = gpu_devices
            .into_iter()
            .map(|(path_on_host, path_in_container)| GpuDevice {
                path_on_host,
                path_in_container,
            })
            .collect();
        c.host_ssh_user = host_ssh_user;
        c.host_ssh_keys = host_ssh_keys.into_iter().map(Into::into).collect();
        c.container_ssh_keys = container_ssh_keys.into_iter().map(Into::into).collect();
        c
    }
}

prop_compose! {
    fn resources()(
        gpus in proptest::collection::vec(".*", 0..4),
        host_keys in proptest::option::of((".*", few(key()), any::<bool>())),
        volumes in few((".*", ".*", ".*")),
        created_dirs in few(".*"),
        unknown_keys in proptest::option::of(proptest::option::of(".*")),
        released in any::<bool>(),
    ) -> Resources {
        Resources {
            gpus,
            host_keys: host_keys
                .map(|(user, keys, upstream)| HostKeysGrant { user, keys, upstream }),
            volumes: volumes
                .into_iter()
                .map(|(name, mount_point, device)| MountedVolume { name, mount_point, device })
                .collect(),
            created_dirs,
            unknown_keys: unknown_keys.map(|user| shim_task::UnknownKeys { user }),
            released,
        }
    }
}

prop_compose! {
    fn task_record()(task in id_str().prop_map(|s| TaskId::new(s).unwrap()))(
        id in Just(task.clone()),
        name in task_name(),
        container_name in id_str(),
        config in proptest::option::of(config(task)),
        status in status(),
        termination_reason in proptest::option::of(reason()),
        termination_message in ".*",
        // The file writes no container as `""`: an id is never empty.
        container_id in proptest::option::of(".+"),
        resources in resources(),
        created_at_ms in any::<u64>(),
        updated_at_ms in any::<u64>(),
    ) -> TaskRecord {
        TaskRecord {
            id,
            name,
            container_name,
            config: config.map(Arc::new),
            status,
            termination_reason,
            termination_message,
            container_id,
            resources,
            created_at_ms,
            updated_at_ms,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn records_round_trip(r in task_record()) {
        let (home, store) = temp_store();
        create_with_record(&store, &r);
        prop_assert_eq!(store.read(&r.container_name).unwrap().unwrap(), stored_form(&r));
        let entries = Store::open(home.path()).unwrap().scan().unwrap();
        prop_assert_eq!(entries.len(), 1);
        match &entries[0] {
            ScanEntry::Record { record: got, .. } => prop_assert_eq!(got, &stored_form(&r)),
            other => prop_assert!(false, "{:?}", other),
        }
    }
}
