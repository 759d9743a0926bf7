//! The on-host contract shared with the upstream shim: its layout and its task.json format,
//! files written by it, files written by the first release of this shim (migrated), and the
//! clean-up of what a crash leaves (trash, skeletons).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers

mod common;

use std::collections::BTreeSet;

use common::{create_with_record, json, names, record, temp_store};
use shim_store::{Origin, ScanEntry, Store};
use shim_task::{TaskRecord, TaskStatus, TerminationReason};

/// A task.json as the upstream shim writes it (dstack PR #4220: format version 1 with `id`,
/// `config`, `termination_reason`, `termination_message`, `cleaned_up`; the config is the
/// Go `TaskConfig` of upstream `runner/internal/shim/models.go`, marshalled by
/// `encoding/json` in struct order, nil slices as `null`, credentials emptied).
const UPSTREAM_TASK_JSON: &str = concat!(
    r#"{"version":1,"id":"66a886db-86db-4cf9-8c06-8984ad15dde2","config":{"#,
    r#""id":"66a886db-86db-4cf9-8c06-8984ad15dde2","name":"vllm-0-0","registry_username":"","#,
    r#""registry_password":"","image_name":"dstackai/base:0.10","container_user":"root","#,
    r#""privileged":false,"gpu":1,"cpu":0,"memory":0,"shm_size":0,"network_mode":"host","#,
    r#""volumes":[{"backend":"aws","name":"data","volume_id":"vol-0123","init_fs":true,"device_name":"/dev/sdf"}],"#,
    r#""volume_mounts":[{"name":"data","path":"/data"}],"instance_mounts":null,"gpu_devices":null,"#,
    r#""host_ssh_user":"ubuntu","host_ssh_keys":["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe k"],"#,
    r#""container_ssh_keys":null},"termination_reason":"","termination_message":"","cleaned_up":false}"#
);

/// The container name upstream gives that task (upstream `runner/internal/shim/task_test.go`:
/// `("vllm-0-0","66a886db-…")` → `vllm-0-0-cff1b8da`).
const UPSTREAM_CONTAINER: &str = "vllm-0-0-cff1b8da";

#[test]
fn a_state_file_written_by_the_upstream_shim_is_adopted_as_is() {
    let (_home, store) = temp_store();
    let p = store.create_task_dir(UPSTREAM_CONTAINER).unwrap();
    fs_err::write(&p.state_file, UPSTREAM_TASK_JSON).unwrap();

    let entries = store.scan().unwrap();
    let [ScanEntry::Record { record, origin }] = &entries[..] else {
        panic!("{entries:#?}");
    };
    assert_eq!(*origin, Origin::Upstream);
    assert_eq!(record.id.as_str(), "66a886db-86db-4cf9-8c06-8984ad15dde2");
    assert_eq!(record.container_name, UPSTREAM_CONTAINER);
    assert_eq!(record.status, TaskStatus::Running);
    assert_eq!(record.termination_reason, None);
    assert!(!record.resources.released);
    let config = record.config.as_ref().unwrap();
    assert_eq!(config.image_name, "dstackai/base:0.10");
    assert_eq!(config.volumes[0].volume_id, "vol-0123");
    assert_eq!(config.host_keys().0.len(), 1);
    // The file is left as upstream wrote it until this shim writes the task.
    let left = fs_err::read_to_string(&p.state_file).unwrap();
    assert_eq!(left, UPSTREAM_TASK_JSON);

    // Terminated by upstream: the reason says so.
    let terminated = UPSTREAM_TASK_JSON
        .replace(
            r#""termination_reason":"""#,
            r#""termination_reason":"terminated_by_user""#,
        )
        .replace(r#""cleaned_up":false"#, r#""cleaned_up":true"#);
    fs_err::write(&p.state_file, terminated).unwrap();
    let r = store.read(UPSTREAM_CONTAINER).unwrap().unwrap();
    assert_eq!(r.status, TaskStatus::Terminated);
    let by_user = Some(TerminationReason::TerminatedByUser);
    assert_eq!(r.termination_reason, by_user);
    assert!(r.resources.released);

    // A config upstream stored but this shim would refuse (a key with a line break): the task
    // is adopted without its config rather than moved aside.
    let odd = UPSTREAM_TASK_JSON.replace(
        r#""host_ssh_keys":["ssh-ed25519"#,
        r#""host_ssh_keys":["x\ny","ssh-ed25519"#,
    );
    fs_err::write(&p.state_file, odd).unwrap();
    let r = store.read(UPSTREAM_CONTAINER).unwrap().unwrap();
    assert!(r.config.is_none());
    assert_eq!(r.name.as_str(), "vllm-0-0");
}

/// What the upstream shim needs from a file this shim wrote: its own fields, with its types.
#[test]
fn a_state_file_written_here_has_every_field_upstream_reads() {
    let (_home, store) = temp_store();
    let mut r = TaskRecord {
        status: TaskStatus::Terminated,
        termination_reason: Some(TerminationReason::DoneByRunner),
        termination_message: "ok".into(),
        ..record("t1")
    };
    r.resources.released = true;
    let written = json(&create_with_record(&store, &r).state_file);
    assert_eq!(written["version"], 1);
    assert_eq!(written["id"], "t1");
    assert_eq!(written["termination_reason"], "done_by_runner");
    assert_eq!(written["termination_message"], "ok");
    assert_eq!(written["cleaned_up"], true);
    // The config carries every field of upstream's TaskConfig, in its order.
    let config = written["config"].as_object().unwrap();
    let keys: BTreeSet<&str> = config.keys().map(String::as_str).collect();
    let upstream = "id name registry_username registry_password image_name container_user \
        privileged gpu cpu memory shm_size network_mode volumes volume_mounts instance_mounts \
        gpu_devices host_ssh_user host_ssh_keys container_ssh_keys";
    assert_eq!(keys, upstream.split_whitespace().collect());
    assert_eq!(config["registry_password"], "");
    // Every field of `TaskConfig` is written: it is `#[non_exhaustive]`, so the format's
    // destructuring cannot list them all, and a field added fails here until it is written.
    let fields = serde_json::to_value(r.config.as_deref().unwrap()).unwrap();
    let fields = fields.as_object().unwrap().keys();
    let fields: BTreeSet<&str> = fields.map(String::as_str).collect();
    let all_written = fields.len() >= 18 && fields.is_subset(&keys);
    assert!(all_written, "{fields:?} not all in {keys:?}");
    // Not terminated: no reason for upstream to read.
    let r2 = TaskRecord {
        status: TaskStatus::Running,
        ..record("t2")
    };
    let written = json(&create_with_record(&store, &r2).state_file);
    assert_eq!(written["termination_reason"], "");
    // And this shim reads back exactly what it wrote.
    assert_eq!(store.read(&r.container_name).unwrap().unwrap(), r);
}

/// The first release kept `tasks/<id>/task.json` as `{"schema_version":1,"task":{..}}`.
fn plant_legacy(home: &std::path::Path, r: &TaskRecord) -> std::path::PathBuf {
    let dir = home.join("tasks").join(r.id.as_str());
    fs_err::create_dir_all(dir.join("runner")).unwrap();
    fs_err::write(dir.join("runner/runner.log"), b"x").unwrap();
    let mut json = serde_json::json!({"schema_version": 1, "task": r});
    // It wrote "no container yet" as `""`.
    json["task"]["container_id"] = r.container_id.clone().unwrap_or_default().into();
    let bytes = serde_json::to_vec_pretty(&json).unwrap();
    fs_err::write(dir.join("task.json"), bytes).unwrap();
    dir
}

#[test]
fn homes_of_the_first_release_are_migrated_durably_and_idempotently() {
    let home = tempfile::tempdir().unwrap();
    let a = record("a");
    let b = TaskRecord {
        status: TaskStatus::Terminated,
        termination_reason: Some(TerminationReason::TerminatedByUser),
        ..record("b")
    };
    plant_legacy(home.path(), &a);
    plant_legacy(home.path(), &b);
    // A directory without a record (a submit cut short) and a foreign one.
    fs_err::create_dir_all(home.path().join("tasks/cut/runner")).unwrap();
    fs_err::create_dir_all(home.path().join("tasks/foreign")).unwrap();
    fs_err::write(home.path().join("tasks/foreign/notes"), b"x").unwrap();

    let store = Store::open(home.path()).unwrap();
    assert!(store.has_legacy_layout());
    assert_eq!(store.legacy_records().len(), 2);
    let report = store.migrate_legacy().unwrap();
    assert_eq!(report.moved, 2);
    assert_eq!(report.left, 1, "the foreign directory stays");
    assert!(!home.path().join("tasks/cut").exists());
    assert_eq!(store.read(&a.container_name).unwrap().unwrap(), a);
    assert_eq!(store.read(&b.container_name).unwrap().unwrap(), b);
    let p = store.paths(&a.container_name).unwrap();
    assert_eq!(names(&p.dir), ["runner", "task.json"]);
    assert!(p.runner_dir.join("runner.log").exists());
    let version = &json(&p.state_file)["version"];
    assert_eq!(version, 1, "rewritten in the new format");

    // Again: nothing to do.
    let again = store.migrate_legacy().unwrap();
    assert_eq!(again.moved, 0);

    // A migration cut short after the rewrite but before the rename resumes.
    let home = tempfile::tempdir().unwrap();
    let dir = plant_legacy(home.path(), &a);
    let store = Store::open(home.path()).unwrap();
    let (_side_home, side) = temp_store();
    let rewritten = create_with_record(&side, &a).state_file;
    fs_err::copy(rewritten, dir.join("task.json")).unwrap();
    let report = store.migrate_legacy().unwrap();
    assert_eq!(report.moved, 1);
    assert!(!home.path().join("tasks").exists());
    assert_eq!(store.read(&a.container_name).unwrap().unwrap(), a);
}

#[test]
fn a_delete_cut_short_leaves_only_trash_which_is_swept() {
    let (_home, store) = temp_store();
    let p = create_with_record(&store, &record("t1"));
    fs_err::write(p.runner_dir.join("log"), b"x").unwrap();
    // A kill after the rename, before the removal: what delete leaves.
    let trash = store.runners_dir().join(".trash-job-t1-1");
    fs_err::rename(&p.dir, &trash).unwrap();
    let entries = store.scan().unwrap();
    assert!(entries.is_empty(), "trash is not a task: {entries:#?}");
    assert_eq!(store.sweep_trash(), 1);
    assert!(names(store.runners_dir()).is_empty());
}

#[test]
fn skeletons_of_submits_cut_short_are_recognised_and_removed() {
    let (_home, store) = temp_store();
    // Directory and empty runner/, no state file: a submit killed before its first write.
    store.create_task_dir("cut-00000001").unwrap();
    // Only the directory.
    fs_err::create_dir(store.runners_dir().join("cut-00000002")).unwrap();
    // A runner/ with something in it: not a skeleton (an upstream task dir, maybe).
    let p = store.create_task_dir("used-00000003").unwrap();
    fs_err::write(p.runner_dir.join("x"), b"x").unwrap();
    let entries = store.scan().unwrap();
    let skeletons: Vec<&str> = entries
        .iter()
        .filter_map(|e| match e {
            ScanEntry::NoRecord { name, skeleton, .. } if *skeleton => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(skeletons, ["cut-00000001", "cut-00000002"]);
    assert!(store.remove_skeleton("cut-00000001").unwrap());
    assert!(store.remove_skeleton("cut-00000002").unwrap());
    assert!(!store.remove_skeleton("used-00000003").unwrap());
    assert_eq!(names(store.runners_dir()), ["used-00000003"]);
}

#[test]
fn the_owner_identity_is_stored_once_in_the_home() {
    let (home, store) = temp_store();
    const FIRST: &str = "0123abcd4567ef89";
    assert_eq!(store.owner_id().unwrap(), None);
    assert_eq!(store.create_owner_id(FIRST).unwrap(), FIRST);
    // Created once: a second identity is not stored, the first one is returned.
    assert_eq!(store.create_owner_id("fedcba9876543210").unwrap(), FIRST);
    // Another spelling of the same home reads the same identity.
    let spelled = format!("{}/./", home.path().display());
    let again = Store::open(spelled).unwrap();
    assert_eq!(again.owner_id().unwrap().as_deref(), Some(FIRST));
    // Something else in the file is refused, never used as a label.
    fs_err::write(home.path().join("owner-id"), b"a b\n").unwrap();
    assert!(store.owner_id().is_err());
}
