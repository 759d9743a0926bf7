//! A task's life, one scenario in every world (see `world/mod.rs`): it runs, its runner's exit
//! ends it, a terminate stops it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod world;

use std::time::Duration;

use world::{Options, World};

// SPEC §2, §4: a task runs with the runner's two ports published (bridge network) and its
// GPU; `running` is recorded in its state file; the runner's exit ends it by its code: 0 →
// `done_by_runner` with no message, 3 → `container_exited_with_error` with the container's
// last five log lines. The exit event is enough (the engine's relist period is an hour in the
// engine worlds). Its resources are released, recorded as released, and its GPU is free again.
async fn a_runners_exit_ends_the_task_by_its_code<W: World>() {
    let w = W::new(Options::default()).await;
    w.submit(&w.task("ok", 1)).await.unwrap();
    w.submit(&w.task("bad", 0)).await.unwrap();
    let ok = w.wait_status("ok", "running").await;
    let ports = ok["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 2, "the runner's http and ssh ports: {ok}");
    assert!(ports.iter().all(|p| p["host"].as_u64() > Some(0)), "{ok}");
    assert_eq!(ok["gpus_ids"].as_array().unwrap().len(), 1, "{ok}");
    w.wait_state_file(&ok, "said running", |f| {
        f["rust_shim"]["status"] == "running"
    })
    .await;
    if let Some(fake) = w.fake() {
        // The container carries this shim's labels.
        let spec = fake.spec(ok["container_id"].as_str().unwrap()).unwrap();
        assert_eq!(spec.labels["ai.dstack.shim.task-id"], "ok");
        assert_eq!(spec.labels["ai.dstack.shim.owner"], w.owner());
    }
    let bad = w.wait_status("bad", "running").await;

    w.exit_runner(&ok, 0).await;
    let done = w.wait_status("ok", "terminated").await;
    assert_eq!(done["termination_reason"], "done_by_runner", "{done}");
    assert_eq!(done["termination_message"], "", "{done}");

    w.exit_runner(&bad, 3).await;
    let failed = w.wait_status("bad", "terminated").await;
    assert_eq!(
        failed["termination_reason"], "container_exited_with_error",
        "{failed}"
    );
    let message = failed["termination_message"].as_str().unwrap();
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines.len(), 5, "{lines:?}");
    assert_eq!(lines[4], "runner exiting with 3");

    w.wait_state_file(&done, "said released", |f| f["cleaned_up"] == true)
        .await;
    w.wait_all_gpus_free().await;
    w.remove("ok").await;
    w.remove("bad").await;
    assert_eq!(w.containers().await, 0);
}
in_worlds!(a_runners_exit_ends_the_task_by_its_code: fake, docker, binary);

// SPEC §4: terminate stops a running task and answers once it is stopped. Timeout 0 is
// `docker stop -t 0` (upstream: runner/internal/shim/docker.go, Terminate: ContainerStop with
// the request's timeout): SIGTERM then SIGKILL at once, so the stub runner (which traps
// SIGTERM) ends 143 or 137; with a grace period it exits on its own (143), well before it
// ends. A second terminate keeps the first reason and message, and so does the exit the
// stop caused (a relist judges nothing again). Its GPU is released; remove deletes the
// container.
async fn terminate_stops_a_running_task_and_keeps_the_first_reason<W: World>() {
    let w = W::new(Options::default()).await;
    w.submit(&w.task("now", 1)).await.unwrap();
    w.submit(&w.task("grace", 0)).await.unwrap();
    let now = w.wait_status("now", "running").await;
    let grace = w.wait_status("grace", "running").await;
    let (now_cid, grace_cid) = (
        now["container_id"].as_str().unwrap(),
        grace["container_id"].as_str().unwrap(),
    );

    let info = w
        .terminate("now", "terminated_by_user", "stop now", 0)
        .await;
    assert_eq!(info["status"], "terminated", "{info}");
    assert_eq!(info["termination_reason"], "terminated_by_user", "{info}");
    let code = w.container_exit_code(now_cid).await;
    assert!(matches!(code, Some(137 | 143)), "exit code {code:?}");

    let info = w
        .terminate("grace", "terminated_by_server", "stop nicely", 10)
        .await;
    assert_eq!(info["termination_reason"], "terminated_by_server", "{info}");
    assert_eq!(w.container_exit_code(grace_cid).await, Some(143));
    if let Some(fake) = w.fake() {
        use shim_runtime::fake::Call;
        let ten = Duration::from_secs(10);
        assert!(
            fake.calls()
                .iter()
                .any(|c| matches!(c, Call::Stop(id, t) if id == grace_cid && *t == ten)),
            "the stop carries the request's timeout"
        );
    }

    let again = w.terminate("now", "terminated_by_server", "again", 0).await;
    assert_eq!(again["termination_reason"], "terminated_by_user", "{again}");
    assert_eq!(again["termination_message"], "stop now", "{again}");
    if let Some(listed) = w.relist().await {
        assert!(listed);
    }
    let grace = w.info("grace").await.unwrap();
    assert_eq!(grace["termination_message"], "stop nicely", "{grace}");

    w.wait_all_gpus_free().await;
    w.remove("now").await;
    w.remove("grace").await;
    assert_eq!(w.container_running(now_cid).await, None);
}
in_worlds!(terminate_stops_a_running_task_and_keeps_the_first_reason: fake, docker, binary);

// SPEC §3/§4: terminate during start answers `terminated`; a remove right after it must then
// be accepted (remove refuses only tasks that are not terminated), as the dstack server sends
// remove right after terminate. The terminates land in every phase of start (the delay after
// submit varies).
// dstack server: src/dstack/_internal/server/services/instances.py
// (remove_dangling_tasks_from_instance: terminate_task, then remove_task at once).
async fn a_remove_right_after_a_terminate_during_start_is_accepted<W: World>() {
    let w = W::new(Options::default()).await;
    let mut refused = Vec::new();
    for i in 0..40u64 {
        let id = format!("early-{i}");
        w.submit(&w.task(&id, 1)).await.unwrap();
        w.sleep(Duration::from_millis(i % 8 * 5)).await;
        let info = w.terminate(&id, "terminated_by_user", "early", 0).await;
        assert_eq!(info["status"], "terminated", "{info}");
        assert_eq!(info["termination_reason"], "terminated_by_user", "{info}");
        if let Err(e) = w.try_remove(&id).await {
            refused.push(format!("{id}: {e}"));
            w.remove(&id).await;
        }
    }
    assert_eq!(
        refused,
        Vec::<String>::new(),
        "removes refused after terminate"
    );
    assert_eq!(w.containers().await, 0);
}
in_worlds!(a_remove_right_after_a_terminate_during_start_is_accepted: fake, docker, binary);

// A task removed after a terminate during its start stays removed: ten clients at once each
// submit, terminate (during start, at varied delays) and remove ten tasks; no directory, no
// container is left behind (the start's late writes included), and none comes back after a
// restart.
async fn a_task_removed_during_its_start_stays_removed<W: World>() {
    let mut w = W::new(Options::default()).await;
    let w_ref = &w;
    futures_util::future::join_all((0..10u64).map(|t| async move {
        for i in 0..10u64 {
            let id = format!("gone-{t}-{i}");
            w_ref.submit(&w_ref.task(&id, 0)).await.unwrap();
            w_ref.sleep(Duration::from_millis((t + i) % 10 * 2)).await;
            w_ref.terminate(&id, "terminated_by_user", "gone", 0).await;
            w_ref.remove(&id).await;
        }
    }))
    .await;
    assert!(w.list().await.is_empty());
    // Late writes, if any, land within milliseconds: give them a moment (not a timed
    // assertion: waiting longer only makes a leftover more likely to be seen).
    w.sleep(Duration::from_millis(500)).await;
    let tasks_dir = shim_e2e::harness::tasks_dir(&w.home());
    let left_behind = shim_e2e::harness::task_entries(&tasks_dir);
    let containers = w.containers().await;
    w.restart().await;
    let after_restart = w.list().await;
    assert_eq!(
        (left_behind.len(), containers, after_restart.len()),
        (0, 0, 0),
        "removed tasks left behind ({left_behind:?}, {containers} containers) or came back \
         after a restart ({after_restart:?})"
    );
}
in_worlds!(a_task_removed_during_its_start_stays_removed: fake, docker, binary);

// SPEC §4: a terminate while the image is being downloaded stops the pull: the task ends at
// once with the requested reason, its start returns at its next step, creates nothing and
// releases its GPU; the pull's log (where there is one) holds the daemon's progress and never
// the registry password.
async fn terminate_during_a_pull_cancels_it<W: World>() {
    let w = W::new(Options::default()).await;
    let image = w.slow_image("world-terminate-pull").await;
    let mut task = w.task("pull", 1);
    image.for_task(&mut task);
    w.submit(&task).await.unwrap();
    let mut info = serde_json::Value::Null;
    for _ in 0..3000 {
        info = w.info("pull").await.unwrap();
        if info["image_pull_progress"]["downloaded_bytes"].as_u64() > Some(0) {
            break;
        }
        w.sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(info["status"], "pulling", "{info}");
    let done = w.terminate("pull", "terminated_by_user", "", 0).await;
    assert_eq!(done["status"], "terminated", "{done}");
    assert_eq!(done["termination_reason"], "terminated_by_user", "{done}");
    w.wait_all_gpus_free().await;
    w.sleep(Duration::from_secs(1)).await;
    let after = w.info("pull").await.unwrap();
    assert_eq!(after["container_id"], "", "nothing created: {after}");
    let name = after["container_name"].as_str().unwrap();
    let log = w.home().join("runners").join(name).join("pull.log");
    if let Ok(log) = fs_err::read_to_string(&log) {
        assert!(w.fake().is_some() || log.contains("Downloading"), "{log}");
        assert!(image.password.is_empty() || !log.contains(&image.password));
    } else {
        assert!(w.fake().is_some(), "a real pull writes its log");
    }
    w.remove("pull").await;
    assert_eq!(w.containers().await, 0);
}
in_worlds!(terminate_during_a_pull_cancels_it: fake, docker, binary);
