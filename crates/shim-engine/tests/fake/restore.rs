//! What a restart keeps: ownership by the runner mount, shared keys, GPU claims, upstream's tasks and what they hold.

use super::*;

/// A task container's spec as the upstream shim creates it: its two labels only (no owner,
/// no GPU label), `/tmp/runner` bound from `runner_dir`.
fn upstream_spec(id: &str, name: &str, runner_dir: &Path) -> ContainerSpec {
    let mut spec = ContainerSpec::new(name, IMAGE);
    let labels = [
        ("ai.dstack.shim.is-task", "true"),
        ("ai.dstack.shim.task-id", id),
    ];
    spec.labels = labels.map(|(k, v)| (k.to_owned(), v.to_owned())).into();
    spec.mounts = vec![BindMount {
        source: runner_dir.to_path_buf(),
        target: "/tmp/runner".to_owned(),
        read_only: false,
    }];
    spec
}

// Issue 22, SPEC §5: ownership is the runner mount, not the label alone. A container whose
// owner label is this shim's but whose runner directory lies in another home is neither
// adopted nor touched, at start-up or at a restart. (The owner identity lost or replaced, two
// homes on one engine: tests/tests/restore.rs, in every world.)
#[tokio::test(start_paused = true)]
async fn a_container_with_our_owner_label_but_another_homes_runner_dir_is_not_ours() {
    let (mut w, engine) = World::with_engine(0).await;
    let elsewhere = tempfile::tempdir().unwrap();
    let runner_dir = elsewhere.path().join("runners/stray-0-01234567/runner");
    let mut stray_spec = upstream_spec("stray", "stray-0-01234567", &runner_dir);
    stray_spec
        .labels
        .insert("ai.dstack.shim.owner".into(), engine.owner().to_owned());
    let stray = w
        .runtime
        .add_container(&stray_spec, ContainerState::Running, None);
    assert!(engine.reconcile_now().await);
    let engine = w.restart(engine).await;
    assert!(engine.task_info(&tid("stray")).is_err(), "another home's");
    assert!(engine.list().is_empty());
    let touched = w.calls_where(|c| matches!(c, Call::Stop(..) | Call::Remove(_)));
    assert_eq!(touched, [], "stopped or removed");
    assert_eq!(w.runtime.state(&stray), Some(ContainerState::Running));
}

// OPERATIONS: two shims on one engine never take each other's containers. A task whose
// container name another home's container holds (the same name and id submitted to both: an
// embedder's fixed ids) fails its create, as a name in use; its remove then acts on no
// container, where it used to force-remove the other home's by that name.
#[tokio::test(start_paused = true)]
async fn a_task_whose_name_another_homes_container_holds_never_touches_it() {
    let (w, engine) = World::with_engine(0).await;
    let elsewhere = tempfile::tempdir().unwrap();
    let name = container_name("t1");
    let runner_dir = elsewhere.path().join("runners").join(&name).join("runner");
    let other = (w.runtime).add_container(
        &upstream_spec("t1", &name, &runner_dir),
        ContainerState::Running,
        None,
    );
    let info = failed_start(&engine, config("t1")).await;
    assert_eq!(info.termination_reason, "creating_container_error");
    engine.remove(&tid("t1")).await.unwrap();
    let touched = w.calls_where(|c| matches!(c, Call::Stop(..) | Call::Remove(_)));
    assert_eq!(touched, [], "stopped or removed");
    assert_eq!(w.runtime.state(&other), Some(ContainerState::Running));
}

#[tokio::test(start_paused = true)]
async fn restart_keeps_shared_key_of_live_task() {
    let (mut w, engine) = World::with_engine(0).await;
    let a = run(&engine, config("a").with_host_key()).await;
    run(&engine, config("b").with_host_key()).await;
    shut_down(engine).await;
    // The restarted process knows no task's keys: unless the engine registers b's before it
    // releases a's, releasing a's would leave the user without the key b still needs.
    w.runtime.exit_without_event(&a.container_id, 0);
    let engine = w.fresh_process().await;
    assert_eq!(info(&engine, "a").status, TaskStatus::Terminated);
    assert_eq!(w.keys.keys_of("ubuntu").len(), 1, "b still needs the key");
}

#[tokio::test(start_paused = true)]
async fn a_duplicate_gpu_claim_after_restart_never_frees_a_gpu_in_use() {
    let (mut w, engine) = World::with_engine(1).await;
    let owner = run(&engine, config("owner").with_gpus(1)).await;
    shut_down(engine).await;
    // A second container claims the same GPU (e.g. left by an older shim without a state
    // file) and has exited.
    let mut spec = w.runtime.spec(&owner.container_id).unwrap();
    spec.name = "stale-00000000".into();
    spec.labels
        .insert("ai.dstack.shim.task-id".into(), "a-stale".into());
    w.runtime
        .add_container(&spec, ContainerState::Exited, Some(0));
    let engine = w.fresh_process().await;
    assert_eq!(info(&engine, "a-stale").status, TaskStatus::Terminated);
    // The stale task's id sorts first, but the running task gets the GPU; the stale one,
    // which exited, locked nothing and must not unlock the GPU the running task uses.
    assert_eq!(engine.gpu_lock().locked(), owner.gpu_ids.clone().unwrap());
    assert_eq!(engine.gpu_lock().free_count(), 0);
    let _ = w.restart(engine).await;
}

// A task terminated while its release was under way (its GPU freed at once, its volume's
// unmount held), a second task given that GPU, and a restart before the first's release was
// written: the first's record still names the GPU. The running task keeps it; the first's
// release at start-up, computed from its record before the GPUs were locked again, frees only
// what the first locked itself (nothing), so the GPU is not handed out twice.
#[tokio::test(start_paused = true)]
async fn a_stale_records_release_after_restart_never_frees_a_gpu_in_use() {
    let (mut w, engine) = World::with_engine(1).await;
    run(&engine, config("first").with_gpus(1).with_data_volume()).await;
    w.volumes.hold_releases();
    terminate_by_user(&engine, "first").await;
    let second = run(&engine, config("second").with_gpus(1)).await;
    shut_down(engine).await;
    w.keys = Arc::new(FakeAuthorizedKeys::new());
    let volumes = w.volumes.clone();
    let (engine, ()) = tokio::join!(w.engine(), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        volumes.let_releases_go();
    });
    // The restore's release ran before `open` returned.
    assert_eq!(info(&engine, "first").status, TaskStatus::Terminated);
    assert_eq!(engine.gpu_lock().locked(), second.gpu_ids.clone().unwrap());
    assert_eq!(engine.gpu_lock().free_count(), 0);
    assert_eq!(w.volumes.mounted(), Vec::<String>::new());
    let _ = w.restart(engine).await;
}

/// A release that hangs at start-up (a stuck unmount, a hung network home) finishes in the
/// background: `open` returns within its wait, the API answers (another task is terminated),
/// and the release completes once the unmount does.
#[tokio::test(start_paused = true)]
async fn a_release_that_hangs_at_start_up_does_not_keep_the_api_down() {
    let (mut w, engine) = World::with_engine(0).await;
    run(&engine, config("held").with_data_volume()).await;
    run(&engine, config("other")).await;
    w.volumes.hold_releases();
    terminate_by_user(&engine, "held").await;
    shut_down(engine).await;
    let opening = tokio::time::timeout(Duration::from_secs(60), w.fresh_process());
    let engine = opening.await.expect("open waited for a release that hangs");
    assert_eq!(info(&engine, "held").status, TaskStatus::Terminated);
    let other = terminate_by_user(&engine, "other").await;
    assert_reason(&other, "terminated_by_user");
    w.volumes.let_releases_go();
    wait_released(&engine, "held").await;
    let _ = w.restart(engine).await;
}

/// A state file as the upstream shim writes it (Go's `json.Marshal` of its state struct:
/// `version`, `id`, `config` in `TaskConfig`'s field order, `termination_reason`,
/// `termination_message`, `cleaned_up`; a slice the server did not send is `null`).
fn upstream_task_json(id: &str, name: &str, gpu: i64, reason: &str, cleaned_up: bool) -> String {
    let parts: [&str; 9] = [
        &format!(r#"{{"version":1,"id":"{id}","config":{{"id":"{id}","name":"{name}","#),
        &format!(r#""registry_username":"","registry_password":"","image_name":"{IMAGE}","#),
        &format!(r#""container_user":"root","privileged":false,"gpu":{gpu},"cpu":0,"memory":0,"#),
        r#""shm_size":0,"network_mode":"bridge","#,
        r#""volumes":[{"backend":"aws","name":"vol1","volume_id":"vol-0123","init_fs":true,"device_name":""}],"#,
        r#""volume_mounts":[{"name":"vol1","path":"/data"}],"instance_mounts":null,"#,
        &format!(r#""gpu_devices":null,"host_ssh_user":"ubuntu","host_ssh_keys":["{KEY}"],"#),
        &format!(r#""container_ssh_keys":[]}},"termination_reason":"{reason}","#),
        &format!(r#""termination_message":"","cleaned_up":{cleaned_up}}}"#),
    ];
    parts.concat()
}

/// The container name of upstream task `id` named `name`, and its directory, made.
fn upstream_dir(w: &World, id: &str, name: &str) -> (String, PathBuf) {
    let name = shim_task::naming::container_name(&TaskName::new(name).unwrap(), &tid(id));
    let dir = w.runner_dir(&name);
    fs_err::create_dir_all(&dir).unwrap();
    (name, dir)
}

/// An engine that adopted upstream task `b1` (`up-b`, no GPU) from its running container,
/// which mounts its whole directory (before state files): its container name and directory.
async fn adopted_whole_dir_task() -> (World, Engine, String, PathBuf) {
    let (mut w, engine) = World::with_engine(0).await;
    let (name, dir) = upstream_dir(&w, "b1", "up-b");
    upstream_container(&w, "b1", &name, &dir, &[]);
    shut_down(engine).await;
    let engine = w.fresh_process().await;
    (w, engine, name, dir)
}

/// A running container as the upstream shim creates it ([`upstream_spec`]), its NVIDIA GPUs
/// as one device request.
fn upstream_container(w: &World, id: &str, name: &str, runner_dir: &Path, gpus: &[String]) {
    let mut spec = upstream_spec(id, name, runner_dir);
    spec.device_requests = vec![DeviceRequest {
        driver: "nvidia".to_owned(),
        device_ids: gpus.to_vec(),
        capabilities: vec!["gpu".to_owned()],
    }];
    w.runtime
        .add_container(&spec, ContainerState::Running, None);
}

// upstream: runner/internal/shim/docker.go (restoreStateFromContainers: NVIDIA GPUs from the
// one device request), runner/internal/shim/models.go (TaskConfig). What an adopted upstream
// task holds besides its container and directory (tests/tests/restore.rs, in every world):
// its GPUs (locked again, never handed out twice, freed exactly), its volume and its key,
// released with it; another home's upstream container's GPUs are not this shim's.
#[tokio::test(start_paused = true)]
async fn upstream_tasks_hold_and_release_exactly_their_gpus_keys_and_volumes() {
    let w = World::new(4);
    let all = w.host_gpus.ids();

    // With a state file: two GPUs, a volume, a key.
    let (name_a, dir_a) = upstream_dir(&w, "a1", "up-a");
    fs_err::create_dir_all(dir_a.join("runner")).unwrap();
    let json_a = upstream_task_json("a1", "up-a", 2, "", false);
    fs_err::write(dir_a.join("task.json"), json_a).unwrap();
    upstream_container(&w, "a1", &name_a, &dir_a.join("runner"), &all[..2]);
    // Without a state file: one GPU. It mounts its whole directory, so the state file its
    // task wrote there (a key for the host's user, a volume, no GPU) is not trusted.
    let (name_b, dir_b) = upstream_dir(&w, "b1", "up-b");
    let json_b = upstream_task_json("b1", "up-b", 0, "", false);
    fs_err::write(dir_b.join("task.json"), json_b).unwrap();
    upstream_container(&w, "b1", &name_b, &dir_b, &all[2..3]);
    // Another home's: its GPU is not ours to lock.
    let elsewhere = tempfile::tempdir().unwrap();
    upstream_container(&w, "c1", "up-c-0-0-87654321", elsewhere.path(), &all[3..]);

    let engine = w.engine().await;
    assert_eq!(info(&engine, "a1").gpu_ids, Some(all[..2].to_vec()));
    assert_eq!(info(&engine, "b1").gpu_ids, Some(all[2..3].to_vec()));
    assert!(engine.task_info(&tid("c1")).is_err(), "another home's task");
    let calls = w.keys.calls();
    let restored = calls.contains(&FakeCall::RestoreKeys(tid("b1")));
    assert!(!restored, "{calls:?}");
    assert_called(&calls, &FakeCall::HoldUnknown(tid("b1"), None));
    assert_eq!(engine.gpu_lock().locked(), all[..3].to_vec());
    // Only one GPU is free: a task asking for two fails to start.
    let big = failed_start(&engine, config("big").with_gpus(2)).await;
    assert_reason(&big, "executor_error");

    // Terminating a1 releases exactly its GPUs, its volume and its key.
    terminate_by_user(&engine, "a1").await;
    reconcile_until(&engine, || engine.gpu_lock().locked() == all[2..3]).await;
    assert_eq!(engine.gpu_lock().locked(), all[2..3].to_vec());
    let release = FakeCall::Release("/fake/volumes/vol1".into());
    assert_called(&w.volumes.calls(), &release);
    let remove_keys = FakeCall::RemoveKeys(tid("a1"), "ubuntu".into());
    assert_called(&w.keys.calls(), &remove_keys);
    terminate_by_user(&engine, "b1").await;
    wait_released(&engine, "b1").await;
}

/// A state file in a directory its container mounts whole (an adopted upstream container from
/// before state files) stays the container's after the container is gone: removed while no
/// shim ran, the next start neither lists the task nor acts on what the file names (a host
/// key, a volume), and deletes the directory and its mark.
#[tokio::test(start_paused = true)]
async fn a_state_file_a_container_could_write_is_not_trusted_once_the_container_is_gone() {
    let (mut w, engine, name, dir) = adopted_whole_dir_task().await;
    assert_eq!(info(&engine, "b1").status, TaskStatus::Running);
    // The container writes a state file naming a host key and a volume, then is removed
    // while no shim runs.
    let json = upstream_task_json("b1", "up-b", 0, "", false);
    fs_err::write(dir.join("task.json"), json).unwrap();
    shut_down(engine).await;
    assert!(w.runtime.vanish(&w.runtime.id_by_name(&name).unwrap()));
    let engine = w.fresh_process().await;
    let forgotten = engine.task_info(&tid("b1")).is_err();
    assert!(forgotten, "forgotten with its container");
    let (keys, volumes) = (w.keys.calls(), w.volumes.calls());
    let untouched = keys.is_empty() && volumes.is_empty();
    assert!(untouched, "{keys:?} {volumes:?}");
    assert!(!dir.exists(), "its directory is deleted");
    let runners = fs_err::read_dir(w.home.path().join("runners")).unwrap();
    let names: Vec<_> = runners.map(|e| e.unwrap().file_name()).collect();
    let left: Vec<_> = names
        .iter()
        .filter(|n| !n.to_string_lossy().starts_with(".spare-"))
        .collect();
    assert!(left.is_empty(), "its mark is deleted too: {left:?}");
    let _ = w.restart(engine).await;
}

/// Upstream's Tenstorrent and Intel Gaudi containers carry no GPU label: their devices are
/// read back from what upstream maps (`/dev/tenstorrent/<id>`, `HABANA_VISIBLE_DEVICES`) and
/// locked again, so the next task is not given them too.
/// upstream: runner/internal/shim/docker.go (restoreStateFromContainers).
#[tokio::test(start_paused = true)]
async fn upstream_tenstorrent_and_gaudi_tasks_keep_their_devices() {
    use shim_resources::gpu::{GpuInfo, GpuVendor};
    for vendor in [GpuVendor::Tenstorrent, GpuVendor::Intel] {
        let mut w = World::new(0);
        w.host_gpus = HostGpus {
            vendor: Some(vendor),
            driver_version: None,
            gpus: (0..2)
                .map(|i| GpuInfo {
                    vendor,
                    name: "accelerator".to_owned(),
                    memory_mib: 0,
                    id: i.to_string(),
                    index: i,
                })
                .collect(),
        };
        let (name, dir) = upstream_dir(&w, "t1", "up");
        fs_err::create_dir_all(dir.join("runner")).unwrap();
        let mut spec = upstream_spec("t1", &name, &dir.join("runner"));
        match vendor {
            GpuVendor::Tenstorrent => spec
                .devices
                .push(shim_runtime::DeviceMapping::same_path("/dev/tenstorrent/1")),
            _ => spec
                .env
                .push(("HABANA_VISIBLE_DEVICES".to_owned(), "1".to_owned())),
        }
        w.runtime
            .add_container(&spec, ContainerState::Running, None);
        let engine = w.engine().await;
        let kept = info(&engine, "t1").gpu_ids;
        assert_eq!(kept, Some(vec!["1".to_owned()]), "{vendor:?}");
        assert_eq!(engine.gpu_lock().locked(), ["1"], "{vendor:?}");
        let next = run(&engine, config("next").with_gpus(1)).await;
        assert_eq!(next.gpu_ids, Some(vec!["0".to_owned()]), "{vendor:?}");
        shut_down(engine).await;
    }
}

/// An upstream state file whose config this shim cannot read (here a task name it refuses)
/// still releases the volumes its container mounts: taken from the container, as for a
/// container without a state file (they were left mounted for ever).
#[tokio::test(start_paused = true)]
async fn an_upstream_task_whose_config_is_unreadable_releases_its_containers_volumes() {
    let w = World::new(0);
    let (name, dir) = upstream_dir(&w, "v1", "up-v");
    fs_err::create_dir_all(dir.join("runner")).unwrap();
    let json = upstream_task_json("v1", "up-v", 0, "", false)
        .replace(r#""name":"up-v","#, r#""name":"not a task name!","#);
    fs_err::write(dir.join("task.json"), json).unwrap();
    let mut spec = upstream_spec("v1", &name, &dir.join("runner"));
    spec.mounts.push(BindMount {
        source: "/fake/volumes/vol1".into(),
        target: "/data".to_owned(),
        read_only: false,
    });
    let cid = w
        .runtime
        .add_container(&spec, ContainerState::Running, None);
    let engine = w.engine().await;
    assert_eq!(info(&engine, "v1").status, TaskStatus::Running);
    assert!(w.runtime.exit(&cid, 0));
    wait_released(&engine, "v1").await;
    let release = FakeCall::Release("/fake/volumes/vol1".into());
    assert_called(&w.volumes.calls(), &release);
}

/// A container cut by the host going down has no end recorded. After the reboot Podman 5 shows
/// it `exited` with the code it was given at its start (0) and no finish time (libpod's
/// `resetContainerState`), Podman 4 `created` again (its refresh): neither is the runner's
/// success nor a container never started. The task ends `container_exited_with_error`, as on
/// Docker, which records 255.
#[tokio::test(start_paused = true)]
async fn a_container_cut_by_the_host_going_down_is_not_a_success() {
    for state in [ContainerState::Exited, ContainerState::Created] {
        let (mut w, engine) = World::with_engine(0).await;
        let running = run(&engine, config("t1")).await;
        shut_down(engine).await;
        assert!(w.runtime.set_state(&running.container_id, state.clone()));
        let engine = w.fresh_process().await;
        let ended = wait_status(&engine, "t1", TaskStatus::Terminated).await;
        assert_reason(&ended, "container_exited_with_error");
        let as_docker_records = ended.termination_message.contains("255");
        assert!(as_docker_records, "{state:?}: {ended:?}");
        let _ = w.restart(engine).await;
    }
}

/// A task whose container is still settling when the shim starts (Podman 4.3's `stopped`: the
/// process ended while the shim was down, the engine's clean-up has not run, so there is no
/// exit code yet, and its `died` came before the subscription) is looked at again within
/// seconds, not at the backstop: once the engine records the exit, the task ends with it, also
/// when a list meant to look at it failed meanwhile. Found by the lifecycle script on Podman
/// 4.3 (`exited-while-down`).
#[tokio::test(start_paused = true)]
async fn a_container_settling_at_start_up_is_listed_again_within_seconds() {
    let (mut w, engine) = World::with_engine(0).await;
    let running = run(&engine, config("t1")).await;
    shut_down(engine).await;
    let stopped = ContainerState::Other("stopped".to_owned());
    assert!(w.runtime.set_state(&running.container_id, stopped));
    let engine = w.fresh_process().await;
    let before = info(&engine, "t1");
    assert_eq!(before.status, TaskStatus::Running, "no exit code yet");
    // The lists fail for a while (the event stream stays up): the next ones look again.
    w.runtime.set_unreachable(true);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(w.runtime.exit_without_event(&running.container_id, 7));
    w.runtime.set_unreachable(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_reason(&info(&engine, "t1"), "container_exited_with_error");
    // Once nothing settles, lists go back to the backstop.
    let lists = w.runtime.count("list");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(w.runtime.count("list"), lists);
    let _ = w.restart(engine).await;
}

/// A task whose container mounts its whole directory keeps its record in memory only: its
/// steps write no file, so none is timed as a state write.
#[tokio::test(start_paused = true)]
async fn a_stateless_tasks_steps_are_not_timed_as_state_writes() {
    let (mut w, engine, _, dir) = adopted_whole_dir_task().await;
    let writes = |engine: &Engine| {
        let metrics = scrape(engine);
        sample(&metrics, "dstack_shim_state_write_seconds_count").unwrap_or_default()
    };
    let before = writes(&engine);
    let ended = terminate(&engine, "b1", "bye", Duration::ZERO).await;
    assert_eq!(ended.status, TaskStatus::Terminated);
    assert_eq!(writes(&engine), before, "its termination wrote no file");
    assert!(!dir.join("task.json").exists());
    let _ = w.restart(engine).await;
}
