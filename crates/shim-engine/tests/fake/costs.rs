//! What a task costs the engine: the Docker requests of a start, an exit and an idle engine, and the state writes of a start.

use super::*;

/// The Docker requests a start makes, counted on the fake: create, start, and (bridge only)
/// one inspect to read the published ports, plus an image check the first time an image is
/// used. Nothing else: no list, and no request from the reconciler because a start returned.
/// An image removed behind the engine's back is pulled when the create finds it missing.
#[tokio::test(start_paused = true)]
async fn a_start_makes_the_minimum_docker_requests() {
    let (w, engine) = World::with_engine(0).await;
    // The engine's one subscription to Docker's events is not a start's.
    w.runtime.wait_for_count("events", 0).await;
    use shim_task::NetworkMode::{Bridge, Host};
    let cases: [(&str, _, &[&str]); 3] = [
        ("first", Host, &["image_present", "create", "start"]),
        ("bridge", Bridge, &["create", "start", "inspect"]),
        ("host", Host, &["create", "start"]),
    ];
    for (id, network_mode, expected) in cases {
        w.runtime.clear_calls();
        let mut c = config(id);
        c.network_mode = network_mode;
        run(&engine, c).await;
        // Let anything a finished start might trigger happen.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(ops(&w), expected, "{id}");
    }

    // The image is pruned behind the engine's back (issue 39): the engine's event says an
    // image went, the next start asks for its image again and pulls it in its pull step
    // (progress shown), then the image is known present again.
    w.runtime.remove_image(IMAGE);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let image_removed = "dstack_shim_events_received_total{kind=\"image_removed\"} 1";
    assert_scraped(&engine, image_removed);
    w.runtime.clear_calls();
    let info = run(&engine, config("pruned")).await;
    // (Running tasks' containers are inspected once, in the background, for their cgroups.)
    let start_ops = || -> Vec<&str> { ops(&w).into_iter().filter(|op| *op != "inspect").collect() };
    let pulled = ["image_present", "pull", "inspect_image", "create", "start"];
    assert_eq!(start_ops(), pulled);
    let progress = info.image_pull_progress.as_ref();
    assert!(progress.is_some_and(|p| p.is_total_bytes_final), "{info:?}");
    w.runtime.clear_calls();
    run(&engine, config("again")).await;
    assert_eq!(start_ops(), ["create", "start"], "known present again");
}

/// A `die` event terminates the task with the code it carries: no inspect, no list; an error
/// reads the last log lines; an `oom` before the `die` says so.
#[tokio::test(start_paused = true)]
async fn exits_come_from_events_without_an_inspect() {
    let (w, engine) = World::with_engine(0).await;
    let oom = format!("killed\n{}", shim_task::machine::OOM_NOTE);
    let error = "container_exited_with_error";
    let (exit, exit_oom) = (FakeRuntime::exit, FakeRuntime::exit_oom);
    let cases: [End<'_>; 3] = [
        ("ok", &[], exit, 0, ("done_by_runner", "")),
        ("bad", &["x", "boom"], exit, 2, (error, "x\nboom")),
        ("oom", &["killed"], exit_oom, 137, (error, &oom)),
    ];
    end_running_tasks(&w, &engine, &cases).await;
    let ops = ops(&w);
    assert!(!ops.contains(&"inspect"), "{ops:?}");
    assert!(!ops.contains(&"list"), "{ops:?}");
    assert_eq!(w.runtime.count("logs_tail"), 2, "{ops:?}");

    // A container whose exit went unannounced, then removed behind the shim's back: its
    // `destroy` event says it vanished.
    let gone = run(&engine, config("gone")).await;
    assert!(w.runtime.exit_without_event(&gone.container_id, 0));
    let removed = shim_runtime::ContainerRuntime::remove(&w.runtime, &gone.container_id);
    removed.await.unwrap();
    let gone = wait_status(&engine, "gone", TaskStatus::Terminated).await;
    let vanished = shim_task::machine::VANISHED_MESSAGE;
    assert_eq!(termination(&gone), ("executor_error", vanished));
}

/// Idle, the engine asks Docker for nothing: no list every second (the full list is a
/// backstop of minutes, an hour in this world), no retries when nothing failed, no request by
/// the image collection's checks (one a minute). Paused time: half an hour runs in
/// milliseconds.
#[tokio::test(start_paused = true)]
async fn idle_costs_no_docker_request() {
    let (w, engine) = World::with_engine(0).await;
    w.runtime.wait_for_count("events", 0).await;
    for i in 0..5 {
        run(&engine, config(&format!("t{i}"))).await;
    }
    w.runtime.clear_calls();
    tokio::time::sleep(Duration::from_secs(1800)).await;
    assert_eq!(w.runtime.calls(), [], "requests while idle");
}

/// The durable writes a start makes when nothing is acquired and the image is present: one,
/// `pending` at submit. The statuses passed on the way (`preparing`, `pulling`, `creating`),
/// the new container's id and `running` are start progress, which the next change writes
/// (SPEC §5: a restart reads them from the container), so a subscriber sees `running` only.
#[tokio::test(start_paused = true)]
async fn a_start_writes_the_state_file_once() {
    let (w, engine) = World::with_engine(0).await;
    let writes = || {
        let count = sample(&scrape(&engine), "dstack_shim_state_write_seconds_count");
        count.unwrap().parse::<u64>().unwrap()
    };
    // The first start checks the image (and may write around that); the second is measured.
    run(&engine, config("warm")).await;
    let mut sub = engine.subscribe();
    let before = writes();
    run(&engine, config("t1")).await;
    let mut kinds = Vec::new();
    while let Ok(Ok(change)) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
        kinds.push(change.kind);
    }
    let status = |status| ChangeKind::Status { status };
    assert_eq!(kinds, [ChangeKind::Submitted, status(TaskStatus::Running)]);
    assert_eq!(writes() - before, 1, "submit's; running is not written");
    let record = state_file(&w, "t1");
    assert_eq!(record["status"], "pending", "{record}");
}

/// A restart costs one list: [`Engine::begin`] sends the start-up list at once (the binary
/// then detects the host's GPUs while Docker answers), and opening the engine asks for no
/// second one; the first reconcile cycle judges the tasks against that list.
#[tokio::test(start_paused = true)]
async fn the_start_up_list_goes_out_at_begin_and_opening_lists_no_more() {
    let (w, engine) = World::with_engine(0).await;
    run(&engine, config("t0")).await;
    shut_down(engine).await;
    w.runtime.clear_calls();

    let deps = w.deps();
    let opening = Engine::begin(deps.runtime.clone(), deps.clock);
    w.runtime.wait_for_count("list", 0).await;
    assert_eq!(ops(&w), ["list"], "before open");
    let engine = opening.open(w.config(), deps).await.unwrap();
    assert_eq!(w.runtime.count("list"), 1, "{:?}", ops(&w));
    assert_eq!(info(&engine, "t0").status, TaskStatus::Running);
}
