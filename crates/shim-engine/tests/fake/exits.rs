//! How the engine learns that a container ended: its events, a relist when an event is missing, the state when an OOM event is, and how it lists after a broken event stream.

use super::*;

/// Issue 29 part 2: one builder of a container's end. Found by a list as by its event, an
/// exit 0 reads no log line (it is `done_by_runner` with no message) and an exit with an error
/// reads them once: the last five of its eight.
#[tokio::test(start_paused = true)]
async fn an_exit_found_by_a_list_is_judged_as_its_event_would_be() {
    let (w, engine) = World::with_engine(0).await;
    let lines: Vec<String> = (1..=8).map(|i| format!("line {i}")).collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let last_five = "line 4\nline 5\nline 6\nline 7\nline 8";
    for (id, code, expected) in [
        ("t0", 0, (("done_by_runner", ""), 0)),
        ("t3", 3, (("container_exited_with_error", last_five), 1)),
    ] {
        let running = run(&engine, config(id)).await;
        w.runtime.set_logs(&running.container_id, &lines);
        w.runtime.clear_calls();
        assert!(w.runtime.exit_without_event(&running.container_id, code));
        assert!(engine.reconcile_now().await);
        let ended = info(&engine, id);
        assert_eq!(ended.status, TaskStatus::Terminated, "{id}");
        let logs_read = w.runtime.count("logs_tail");
        assert_eq!((termination(&ended), logs_read), expected, "{id}");
    }
}

/// A cycle never judges a task by a list requested before the task's start ended: that list
/// cannot show the container the start made. Here the list answers late, after the start,
/// with what it saw when requested (no container). Until 2026-11-30 the check compared
/// millisecond stamps and stamped the start's end only after the task had left the start's
/// ownership, so a start ending in the list's millisecond, or a cycle reaching the task in
/// between, judged it by the older list and could call its new container vanished.
#[tokio::test(start_paused = true)]
async fn a_list_requested_before_a_start_ended_does_not_judge_the_task() {
    let (w, engine) = World::with_engine(0).await;
    let lists = w.runtime.count("list");
    w.runtime.hold_lists();
    let cycle = tokio::spawn({
        let engine = engine.clone();
        async move { engine.reconcile_now().await }
    });
    w.runtime.wait_for_count("list", lists).await;
    let running = run(&engine, config("t1")).await;
    w.runtime.release_lists();
    assert!(cycle.await.unwrap(), "the held list answered");
    let after = info(&engine, "t1");
    assert_eq!(after.status, TaskStatus::Running, "{after:?}");
    assert_eq!(w.state_of(&running), Some(ContainerState::Running));
    // A list requested after the start ended does judge it: here the container exited
    // without an event, and the cycle finds it.
    assert!(w.runtime.exit_without_event(&running.container_id, 3));
    assert!(engine.reconcile_now().await);
    assert_reason(&info(&engine, "t1"), "container_exited_with_error");
}

/// A runtime whose event subscription fails only when its stream is read (bollard's, while
/// the daemon is down) does not keep the engine resubscribing, and relisting, at the shortest
/// delay: a connection that broke before it carried anything lets the backoff grow. Once the
/// daemon is back the engine subscribes again and lists.
#[tokio::test(start_paused = true)]
async fn an_event_stream_that_breaks_at_once_backs_off() {
    let (w, engine) = World::with_engine(0).await;
    // Subscribed before the engine is handed out: a shim serves subscribed.
    assert!(engine.health().events_connected, "{:?}", engine.health());
    w.runtime.set_event_subscriptions_fail_late(true);
    w.runtime.set_unreachable(true);
    let before = w.runtime.count("events");
    w.runtime.break_event_streams();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let attempts = w.runtime.count("events") - before;
    // At the shortest delay (200 ms) 7 or 8 would come; backing off (200, 400, 800 ms), 3.
    assert!((1..=4).contains(&attempts), "{attempts} in 1.5 s");
    let lists = w.runtime.count("list");
    w.runtime.set_unreachable(false);
    poll_until(1000, TICK, async || {
        engine.health().events_connected && w.runtime.count("list") > lists
    })
    .await;
    assert!(engine.health().events_connected, "{:?}", engine.health());
    assert!(w.runtime.count("list") > lists, "the reconnection relists");
}

/// SPEC §4: Docker's events are followed; a full list runs at start-up, on every
/// (re)connection of the event stream and as a backstop of minutes, never every second. An
/// engine opened with `EngineConfig::new`'s defaults (nothing set but the home) lists once at
/// start-up and once per reconnection in its first five minutes, then the backstop lists.
/// Paused time: five minutes run in milliseconds.
#[tokio::test(start_paused = true)]
async fn the_default_config_lists_only_at_start_up_and_on_reconnection() {
    let w = World::new(0);
    let cfg = EngineConfig::new(w.home.path());
    let default = EngineConfig::DEFAULT_RECONCILE_INTERVAL;
    assert_eq!(cfg.reconcile_interval, default);
    let opened = tokio::time::Instant::now();
    let engine = Engine::open(cfg, w.deps()).await.unwrap();
    let lists = || w.runtime.count("list");
    assert_eq!(lists(), 1, "the start-up list");
    assert_eq!(w.runtime.count("events"), 1, "the first subscription");
    // Tasks to look at: a cycle would have work (and requests to make).
    for i in 0..3 {
        run(&engine, config(&format!("t{i}"))).await;
    }
    let until = |s: u64| tokio::time::sleep_until(opened + Duration::from_secs(s));
    until(120).await;
    assert_eq!(lists(), 1, "lists in the first two minutes");
    // Docker restarts: the stream reconnects (`since` the last event) and lists once.
    w.runtime.break_event_streams();
    until(150).await;
    assert_eq!(w.runtime.count("events"), 2, "one resubscription");
    assert!(engine.health().events_connected, "{:?}", engine.health());
    assert_eq!(lists(), 2, "one list for the reconnection");
    until(299).await;
    // In the first five minutes: the start-up list and one per reconnection.
    assert_eq!(lists(), 2, "lists in the first five minutes");
    // The backstop comes at five minutes.
    until(301).await;
    assert_eq!(lists(), 3, "the backstop list");
    let health = engine.health();
    assert!(health.is_ready(), "{:?}", health.reasons());
}

/// Task `t1` run on an engine of `w` that is then dropped, every later event subscription
/// held, and the config to open the engine again.
async fn t1_running_then_subscriptions_held(w: &World) -> (TaskInfo, EngineConfig) {
    let engine = w.engine().await;
    let t1 = run(&engine, config("t1")).await;
    drop(engine);
    w.runtime.hold_subscriptions();
    let mut cfg = EngineConfig::new(w.home.path());
    cfg.volumes_root = "/fake/volumes".into();
    (t1, cfg)
}

/// SPEC §4: a list runs whenever the event stream connects. When the subscription made beside
/// the start-up list fails (the daemon restarting under the shim's restart), the first one
/// that succeeds later lists too: an exit whose event the restarted daemon no longer has is
/// found at once, not at the backstop five minutes on.
#[tokio::test(start_paused = true)]
async fn a_first_subscription_that_comes_late_lists() {
    let w = World::new(0);
    let (t1, cfg) = t1_running_then_subscriptions_held(&w).await;
    let engine = Engine::open(cfg, w.deps()).await.unwrap();
    assert!(!engine.health().events_connected);
    let lists = w.runtime.count("list");
    assert!(w.runtime.exit_without_event(&t1.container_id, 1));
    w.runtime.release_subscriptions();
    let info = wait_status(&engine, "t1", TaskStatus::Terminated).await;
    let one_more = w.runtime.count("list") - lists;
    assert_eq!(one_more, 1, "one list for the connection");
    assert_eq!(info.termination_reason, "container_exited_with_error");
}

/// The same when the subscription made at start-up succeeds, but only seconds after the
/// start-up list (a program that detects GPUs between `Engine::begin` and `open`, a slow
/// daemon): Docker replays the events since the list only from the last 256 it buffered, none
/// from before its own restart, so that connection lists too, and an exit the daemon no
/// longer has is found at once. It was taken as covered by the start-up list: the task read
/// `running` until the backstop list five minutes on.
#[tokio::test(start_paused = true)]
async fn a_first_subscription_that_connects_late_lists() {
    let w = World::new(0);
    let (t1, cfg) = t1_running_then_subscriptions_held(&w).await;
    let opening = tokio::spawn(Engine::open(cfg, w.deps()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(w.runtime.exit_without_event(&t1.container_id, 1));
    w.runtime.release_subscriptions();
    let engine = opening.await.unwrap().unwrap();
    assert!(engine.health().events_connected, "subscribed, late");
    let ended = wait_status(&engine, "t1", TaskStatus::Terminated);
    let info = tokio::time::timeout(Duration::from_secs(10), ended).await;
    let info = info.expect("found at once, not at the backstop");
    assert_eq!(info.termination_reason, "container_exited_with_error");
}

/// Podman sends no `oom` event: a `die` with 137 and no `oom` before it asks the container's
/// state, whose OOM flag says so (one inspect); a 137 that was no OOM kill stays one.
#[tokio::test(start_paused = true)]
async fn an_oom_kill_without_an_oom_event_is_read_from_the_state() {
    let (w, engine) = World::with_engine(0).await;
    let oom = format!("killed\n{}", shim_task::machine::OOM_NOTE);
    let error = "container_exited_with_error";
    let (silent_oom, exit) = (FakeRuntime::exit_oom_without_oom_event, FakeRuntime::exit);
    let cases: [End<'_>; 2] = [
        ("oom", &["killed"], silent_oom, 137, (error, &oom)),
        ("killed", &["killed"], exit, 137, (error, "killed")),
    ];
    end_running_tasks(&w, &engine, &cases).await;
    let ops = ops(&w);
    assert_eq!(w.runtime.count("inspect"), 2, "{ops:?}");
    assert!(!ops.contains(&"list"), "{ops:?}");
}
