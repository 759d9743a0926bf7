//! A task's life on the engine: submit, start and its failures, terminate in every state and within its budget, remove, a failed state write, the engine's own shutdown.

use super::*;

// A submit answers `pending` with the container's name fixed; in the host's network a running
// task publishes no ports (`[]`, not `null`), and its GPU is locked. (The runner's exit by its
// code, in every world: tests/tests/lifecycle.rs.)
#[tokio::test(start_paused = true)]
async fn submit_answers_pending_and_host_network_publishes_no_ports() {
    let (_w, engine) = World::with_engine(2).await;
    let info = engine.submit(config("t1").with_gpus(1)).await.unwrap();
    assert_eq!(info.status, TaskStatus::Pending);
    assert!(info.container_name.starts_with("job-"));
    let info = wait_status(&engine, "t1", TaskStatus::Running).await;
    assert_eq!(info.ports, Some(vec![]));
    assert_eq!(engine.gpu_lock().locked(), info.gpu_ids.unwrap());
}

// A caller that goes away does not cancel a submit or a remove half-way (the dstack server's
// client gives up after 9 s, and the HTTP server then drops the request's future): the task
// still starts, and the remove still ends with the task forgotten, its GPU free and its
// container gone. Dropped half-way, the submit left the id taken and the task `pending` with
// no start to follow, and every remove of it a conflict. (Upstream's handlers run to their end
// whatever the client does: runner/internal/shim/api/handlers.go.)
#[tokio::test(start_paused = true)]
async fn a_caller_that_goes_away_cancels_no_submit_or_remove() {
    use futures_util::FutureExt;
    let (w, engine) = World::with_engine(1).await;
    let submit = engine.submit(config("t1").with_gpus(1)).now_or_never();
    assert!(submit.is_none(), "the submit answered at once");
    let known = poll_until(100, TICK, async || engine.task_info(&tid("t1")).is_ok());
    assert!(known.await, "the submit went with its caller");
    let info = wait_status(&engine, "t1", TaskStatus::Running).await;
    assert_eq!(engine.gpu_lock().locked(), info.gpu_ids.unwrap());
    terminate_by_user(&engine, "t1").await;
    let id = tid("t1");
    let remove = engine.remove(&id).now_or_never();
    assert!(remove.is_none(), "the remove answered at once");
    let gone = poll_until(100, Duration::from_millis(50), async || {
        engine.task_info(&id).is_err()
    });
    assert!(gone.await, "the task stayed");
    assert_eq!(engine.gpu_lock().locked(), Vec::<String>::new());
    assert_eq!(w.runtime.container_ids().len(), 0);
}

/// Issue 28: every task container's log is bounded. The engine's default config gives the
/// container `json-file` limits of 100 MiB × 3; a configured size and count reach the spec as
/// they are; `None` (the binary's `--container-log-max-size daemon`) leaves the spec without
/// limits, so the daemon's own log configuration applies.
#[tokio::test(start_paused = true)]
async fn the_configured_log_limits_reach_the_containers_spec() {
    use shim_runtime::LogLimits;
    let w = World::new(0);
    let default = LogLimits::new(
        EngineConfig::DEFAULT_CONTAINER_LOG_MAX_SIZE,
        EngineConfig::DEFAULT_CONTAINER_LOG_MAX_FILES,
    );
    assert_eq!(default.total_bytes(), 300 << 20);
    assert_eq!(w.config().container_log, Some(default), "the default");
    let custom = LogLimits::new((1 << 20).try_into().unwrap(), 2.try_into().unwrap());
    for (id, limits, expected) in [
        ("default", None, Some(default)),
        ("custom", Some(Some(custom)), Some(custom)),
        ("daemon", Some(None), None),
    ] {
        let engine = w
            .engine_with(|cfg| cfg.container_log = limits.unwrap_or(cfg.container_log))
            .await;
        let info = run(&engine, config(id)).await;
        let spec = w.runtime.spec(&info.container_id).unwrap();
        assert_eq!(spec.log, expected, "{id}");
        shut_down(engine).await;
    }
}

// A period the engine's timers cannot run with (zero, or past the clock's range: tokio's
// interval panics on both) is refused at open; taken, it killed the reconciler or the GPU
// health watch after the engine had opened, with nothing else to run them.
#[tokio::test(start_paused = true)]
async fn a_timer_period_it_cannot_run_with_is_refused_at_open() {
    let w = World::new(1);
    type Set = fn(&mut EngineConfig, Duration);
    // Each period, and whether zero is taken (the GPU health watch off).
    let periods: [(Set, bool); 2] = [
        (|c, p| c.reconcile_interval = p, false),
        (|c, p| c.gpu_health_interval = p, true),
    ];
    let too_long = EngineConfig::MAX_PERIOD + Duration::from_secs(1);
    for (set, zero_ok) in periods {
        for period in [Duration::ZERO, Duration::MAX, too_long] {
            let mut cfg = w.config();
            set(&mut cfg, period);
            let opened = Engine::open(cfg, w.deps()).await;
            let invalid = matches!(opened, Err(shim_engine::EngineError::InvalidConfig(_)));
            assert_eq!(invalid, !(period.is_zero() && zero_ok), "{period:?}");
        }
    }
    let mut cfg = w.config();
    cfg.reconcile_interval = EngineConfig::MAX_PERIOD;
    cfg.gpu_health_interval = EngineConfig::MAX_PERIOD;
    let engine = Engine::open(cfg, w.deps()).await.unwrap();
    engine.submit(config("t1")).await.unwrap();
    wait_status(&engine, "t1", TaskStatus::Running).await;
}

/// Dropping the last handle of an engine stops its background jobs (the event listener, the
/// reconciler, the retry pass): they hold the parts they use, never the handle. Once they
/// ended, nothing holds the engine's change feed, so a subscription ends with `Closed`, and no
/// Docker request is made any more.
#[tokio::test(start_paused = true)]
async fn dropping_the_last_engine_handle_stops_its_background_jobs() {
    let (w, engine) = World::with_engine(0).await;
    let mut changes = engine.subscribe();
    run(&engine, config("t1")).await;
    let clone = engine.clone();
    drop(engine);
    // A clone keeps it running.
    assert!(clone.reconcile_now().await);
    assert!(clone.health().events_connected);
    drop(clone);
    let closed = until_closed(&mut changes, Duration::from_secs(5)).await;
    assert_eq!(closed, shim_engine::SubscriptionError::Closed);
    // Nothing asks Docker any more (the retry pass and the listener are gone), and the
    // container keeps running.
    w.runtime.clear_calls();
    w.runtime.break_event_streams();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(w.runtime.calls(), [], "requests after the drop");
    assert_eq!(w.runtime.container_ids().len(), 1);
}

/// A shut-down engine does not look alive to its embedder: its change subscriptions end
/// (after the changes sent before), it is not ready, and it refuses submits, terminates and
/// removes, whose containers nothing would watch; its views answer. It used to stay ready,
/// keep its subscriptions open for ever, and start tasks whose exits were never seen.
#[tokio::test(start_paused = true)]
async fn a_shut_down_engine_ends_its_subscriptions_is_not_ready_and_starts_nothing() {
    let (w, engine) = World::with_engine(0).await;
    let mut changes = engine.subscribe();
    engine.submit(config("t1")).await.unwrap();
    engine.shutdown(Shutdown::Now).await;
    let closed = until_closed(&mut changes, Duration::from_secs(5)).await;
    assert_eq!(closed, shim_engine::SubscriptionError::Closed);
    assert!(!engine.health().is_ready(), "{:?}", engine.health());
    let creates = w.runtime.count("create");
    let refused = engine.submit(config("t2")).await.unwrap_err();
    assert_eq!(refused.to_string(), "the engine is shut down");
    assert_eq!(w.runtime.count("create"), creates);
    let (t1, user) = (tid("t1"), TerminationReason::TerminatedByUser);
    let stop = engine.terminate(&t1, user, String::new(), Duration::ZERO);
    let stop = stop.await.unwrap_err();
    let remove = engine.remove(&t1).await.unwrap_err();
    for refused in [stop, remove] {
        assert_eq!(refused.to_string(), "the engine is shut down");
    }
    assert!(engine.task_info(&t1).is_ok(), "its views still answer");
}

/// A start job still in flight when a shutdown has waited as long as it would (a long pull)
/// stops where it is, as a crash would stop it: an engine opened next on the home (in the same
/// process, by an embedder) finds the task as after a restart, and the old job neither
/// creates its container nor writes its record behind the new engine. It used to run on,
/// starting the container with GPUs the new engine then gave to another task.
#[tokio::test(start_paused = true)]
async fn a_start_still_pulling_at_shutdown_stops_where_it_is() {
    let (w, engine) = World::with_engine(1).await;
    let c = config("t1").with_image("img:latest").with_gpus(1);
    let info = submit_held_in_its_pull(&w, &engine, c).await;
    let graceful = Shutdown::Graceful(Duration::from_secs(1));
    engine.shutdown(graceful).await;
    let record = fs_err::read_to_string(w.task_json(&info.container_name)).unwrap();
    w.runtime.release_pulls();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let creates = w.runtime.count("create");
    assert_eq!(creates, 0, "a container started after the shutdown");
    let after = fs_err::read_to_string(w.task_json(&info.container_name)).unwrap();
    assert_eq!(after, record, "the record written after the shutdown");
}

/// Shutdown does not wait for an event subscription in progress: subscribing asks the daemon,
/// and a frozen one would hold it up to the request timeout (30 s; the engine gives its
/// background jobs 10 s before it leaves them).
#[tokio::test(start_paused = true)]
async fn shutdown_does_not_wait_for_a_subscription_in_progress() {
    let (w, engine) = World::with_engine(0).await;
    let subscriptions = w.runtime.count("events");
    w.runtime.hold_subscriptions();
    w.runtime.break_event_streams();
    w.runtime.wait_for_count("events", subscriptions).await;
    let shutdown = tokio::time::timeout(Duration::from_secs(5), engine.shutdown(Shutdown::Now));
    assert!(shutdown.await.is_ok(), "waited for the subscription");
    w.runtime.release_subscriptions();
}

/// A terminate while an instance directory is being made on a file system that does not
/// answer (a frozen one here; a hung NFS mount blocks the same way) ends the start at once: the
/// task is terminated, its GPU released and its remove answered, while the blocked call waits
/// on. It used to hold the GPU, and answer a remove 409, until the file system answered.
/// (Real time: a blocked thread of the blocking pool holds paused time still.)
#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn a_terminate_while_an_instance_directory_hangs_releases_the_task() {
    shim_util::testing::require_root();
    let dir = tempfile::tempdir().unwrap();
    let frozen = shim_util::testing::FrozenFs::new(dir.path());
    let (_w, engine) = World::with_engine(1).await;
    let mut c = config("t1").with_gpus(1);
    c.instance_mounts = vec![shim_task::InstanceMountPoint {
        instance_path: frozen.mount.join("cache").to_string_lossy().into_owned(),
        path: "/cache".into(),
    }];
    engine.submit(c).await.unwrap();
    // A thread of this process blocked in the kernel: the `mkdir` on the frozen file system.
    let blocked = || {
        let tasks = fs_err::read_dir("/proc/self/task").unwrap();
        tasks.flatten().any(|t| {
            let stat = fs_err::read_to_string(t.path().join("stat")).unwrap_or_default();
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('D'))
        })
    };
    assert!(
        poll_until(500, TICK, async || blocked()).await,
        "no mkdir blocked"
    );
    let (t1, user) = (tid("t1"), TerminationReason::TerminatedByUser);
    let stop = engine.terminate(&t1, user, String::new(), Duration::ZERO);
    stop.await.unwrap();
    wait_released(&engine, "t1").await;
    engine.remove(&tid("t1")).await.unwrap();
    drop(frozen);
}

#[tokio::test(start_paused = true)]
async fn terminate_during_container_start_stops_the_container() {
    let (w, engine) = World::with_engine(0).await;
    w.runtime.set_start_behavior(StartBehavior::Hang);
    engine.submit(config("t1")).await.unwrap();
    w.runtime.wait_for_count("start", 0).await;
    // Terminate waits for start to let go; the hanging start proceeds a moment later.
    let runtime = w.runtime.clone();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        runtime.release_starts();
    });
    let info = terminate_by_user(&engine, "t1").await;
    release.await.unwrap();
    assert_reason(&info, "terminated_by_user");
    let starting = engine.is_starting(&tid("t1")).unwrap();
    assert!(!starting, "terminate returned after start");
    // Start noticed at its next step and stopped the container it had just started.
    assert_eq!(w.state_of(&info), Some(ContainerState::Exited));
    // Nothing is left to release: a remove right away is accepted.
    engine.remove(&tid("t1")).await.unwrap();
    assert_eq!(w.state_of(&info), None);
}

/// A start that fails where the container may run all the same (bridge mode: it started, and
/// the inspect that reads its ports failed) ends the task, but its GPU is given back only
/// once the container is stopped: a release right away left it running with a GPU the next
/// task could be given.
#[tokio::test(start_paused = true)]
async fn a_start_that_may_have_run_is_stopped_before_its_gpu_goes() {
    let (w, engine) = World::with_engine(1).await;
    w.runtime.set_start_behavior(StartBehavior::Hang);
    let mut c = config("t1").with_gpus(1);
    c.network_mode = shim_task::NetworkMode::Bridge;
    engine.submit(c).await.unwrap();
    w.runtime.wait_for_count("start", 0).await;
    w.runtime.set_unreachable(true);
    w.runtime.release_starts();
    let ended = poll_until(100, TICK, async || {
        info(&engine, "t1").status == TaskStatus::Terminated
    });
    assert!(ended.await);
    let t1 = info(&engine, "t1");
    assert_ended(&t1, "container_exited_with_error", "cannot be inspected");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(w.state_of(&t1), Some(ContainerState::Running));
    assert_eq!(engine.gpu_lock().locked().len(), 1, "held while it may run");
    w.runtime.set_unreachable(false);
    let released = poll_until(3000, TICK, async || engine.gpu_lock().locked().is_empty());
    assert!(released.await);
    let stopped = Some(ContainerState::Exited);
    assert_eq!(w.state_of(&t1), stopped, "stopped first");
}

// A start that is slow (the container not running yet) is waited for, with a look at the
// container every 5 s; one whose answer is late while the container already runs goes on at
// the first look (every world: tests/tests/faults.rs,
// a_start_whose_answer_never_comes_runs_in_seconds).
#[tokio::test(start_paused = true)]
async fn a_slow_start_is_waited_for_with_a_look_every_5_s() {
    let (w, engine) = World::with_engine(0).await;
    w.runtime.set_start_behavior(StartBehavior::Hang);
    w.runtime.clear_calls();
    engine.submit(config("slow")).await.unwrap();
    w.runtime.wait_for_count("start", 0).await;
    w.runtime.clear_calls();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(info(&engine, "slow").status, TaskStatus::Pending);
    assert_eq!(w.runtime.count("inspect"), 2, "a look at 5 s and at 10 s");
    w.runtime.release_starts();
    let running = wait_status(&engine, "slow", TaskStatus::Running).await;
    assert_eq!(w.state_of(&running), Some(ContainerState::Running));
}

#[tokio::test(start_paused = true)]
async fn start_step_failures_map_to_reasons() {
    let (w, engine) = World::with_engine(1).await;

    // Not enough GPUs → executor_error, nothing locked.
    let info = failed_start(&engine, config("gpu").with_gpus(2)).await;
    assert_ended(&info, "executor_error", "GPU");
    assert!(engine.gpu_lock().locked().is_empty());

    // SSH keys cannot be added → executor_error, GPUs released.
    w.keys.set_fail(true);
    let info = failed_start(&engine, config("keys").with_gpus(1).with_host_key()).await;
    assert_reason(&info, "executor_error");
    wait_released(&engine, "keys").await;
    w.keys.set_fail(false);

    // A volume cannot be prepared → executor_error.
    w.volumes.fail_prepare("data", true);
    let info = failed_start(&engine, config("vol").with_data_volume()).await;
    assert_ended(&info, "executor_error", "data");

    // Pull fails → creating_container_error with the daemon's message.
    w.runtime.set_pull_behavior(PullBehavior::Fail {
        steps: vec![],
        message: "manifest unknown".into(),
    });
    let info = failed_start(&engine, config("pull").with_image("missing:2")).await;
    assert_ended(&info, "creating_container_error", "manifest unknown");

    // Start fails → container_exited_with_error.
    w.runtime
        .set_start_behavior(StartBehavior::Fail("exec format error".into()));
    let info = failed_start(&engine, config("start")).await;
    assert_ended(&info, "container_exited_with_error", "exec format error");
}

/// Found in review: a task that holds nothing and whose stop failed (the daemon did not
/// answer) is stopped by the one-second retry pass once the daemon answers again, not only by
/// the backstop list (an hour here) or by Docker's news.
#[tokio::test(start_paused = true)]
async fn a_failed_stop_is_retried_by_the_retry_pass() {
    let (w, engine) = World::with_engine(0).await;
    let running = run(&engine, config("t1")).await;
    w.runtime.set_unreachable(true);
    let answered = terminate_by_user(&engine, "t1").await;
    // Terminated (durably); the stop failed and is left to the reconciler.
    assert_reason(&answered, "terminated_by_user");
    let still_runs = || w.state_of(&running) == Some(ContainerState::Running);
    assert!(still_runs());
    w.runtime.set_unreachable(false);
    // Looked at every 50 ms for 20 s.
    let stopped = poll_until(400, Duration::from_millis(50), async || !still_runs()).await;
    assert!(stopped, "the container runs: the stop was not retried");
    assert_reason(&info(&engine, "t1"), "terminated_by_user");
}

/// One task's stop that hangs for its whole bound (a container stuck in the kernel) holds up
/// no other task's retry: another task's release, failing until now, is retried within
/// seconds of the fault clearing (SPEC §4), while the hung stop is still out.
#[tokio::test(start_paused = true)]
async fn a_hung_stop_holds_up_no_other_tasks_retry() {
    let (w, engine) = World::with_engine(0).await;
    run(&engine, config("t1")).await;
    run(&engine, config("t2").with_data_volume()).await;
    w.volumes.fail_release("data", true);
    terminate_by_user(&engine, "t2").await;
    assert_eq!(w.volumes.mounted(), ["data"], "its release failed");
    w.runtime.set_unreachable(true);
    terminate_by_user(&engine, "t1").await;
    w.runtime.hold_stops();
    w.runtime.set_unreachable(false);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stops = w.runtime.count("stop");
    assert!(stops >= 2, "t1's stop is retried, and hangs");
    w.volumes.fail_release("data", false);
    let released = poll_until(30, Duration::from_millis(100), async || {
        w.volumes.mounted().is_empty()
    })
    .await;
    assert!(released, "t2's release waited behind t1's hung stop");
    w.runtime.release_stops();
    wait_released(&engine, "t1").await;
}

/// One task's release that hangs in a cycle (its exit found by a list: an unmount stuck on a
/// dead device) holds up neither another task's end found by the same list nor the cycle: the
/// cycle ends, the next ones run, and the release finishes once the unmount does.
#[tokio::test(start_paused = true)]
async fn a_release_that_hangs_in_a_cycle_holds_up_no_other_task() {
    let (w, engine) = World::with_engine(0).await;
    let held = run(&engine, config("t1").with_data_volume()).await;
    let other = run(&engine, config("t2")).await;
    w.volumes.hold_releases();
    for info in [&held, &other] {
        let cid = &info.container_id;
        assert!(w.runtime.exit_without_event(cid, 0));
    }
    let cycle = tokio::time::timeout(Duration::from_secs(60), engine.reconcile_now());
    assert!(cycle.await.expect("the cycle waited for a hung release"));
    assert_reason(&info(&engine, "t2"), "done_by_runner");
    assert_eq!(info(&engine, "t1").status, TaskStatus::Terminated);
    assert!(engine.reconcile_now().await, "the next cycle runs");
    w.volumes.let_releases_go();
    wait_released(&engine, "t1").await;
}

// Issue 22, SPEC §4: terminate answers within `timeout` + its slack in every state, whatever
// holds it up: a stop the daemon does not finish, a start in flight, a slow unmount. Each hold
// is released only after the answer came; what was not done then finishes in the background
// and the task converges (container stopped, everything released, remove accepted).
#[tokio::test(start_paused = true)]
async fn terminate_answers_within_its_budget_whatever_holds_it_up() {
    let w = World::new(3);
    let engine = w.engine_with(|cfg| cfg.terminate_slack = SLACK).await;

    // A stop the daemon holds.
    let running = run(&engine, config("t-stop").with_gpus(1)).await;
    w.runtime.hold_stops();
    let info = terminate_now(&engine, "t-stop", "a held stop").await;
    // Durable before the stop, which is still held; the GPU is released after it.
    assert_reason(&info, "terminated_by_user");
    assert_eq!(w.state_of(&running), Some(ContainerState::Running));
    assert_eq!(engine.gpu_lock().locked().len(), 1);
    w.runtime.release_stops();

    // A start in flight (the daemon holds the container's start).
    w.runtime.set_start_behavior(StartBehavior::Hang);
    let starts = w.runtime.count("start");
    engine.submit(config("t-start").with_gpus(1)).await.unwrap();
    w.runtime.wait_for_count("start", starts).await;
    let info = terminate_now(&engine, "t-start", "a start in flight").await;
    assert_reason(&info, "terminated_by_user");
    assert!(engine.is_starting(&tid("t-start")).unwrap());
    w.runtime.set_start_behavior(StartBehavior::Succeed);
    w.runtime.release_starts();

    // A slow unmount (the release of its volume is held).
    run(&engine, config("t-unmount").with_gpus(1).with_data_volume()).await;
    w.volumes.hold_releases();
    let info = terminate_now(&engine, "t-unmount", "a slow unmount").await;
    assert_reason(&info, "terminated_by_user");
    assert_eq!(w.volumes.mounted(), ["data"], "the unmount is still held");
    w.volumes.let_releases_go();

    // Everything converges in the background.
    for id in ["t-stop", "t-start", "t-unmount"] {
        poll_until(500, TICK, async || {
            engine.reconcile_now().await;
            !engine.is_starting(&tid(id)).unwrap() && engine.remove(&tid(id)).await.is_ok()
        })
        .await;
        assert!(engine.task_info(&tid(id)).is_err(), "{id} not removed");
    }
    assert!(engine.gpu_lock().locked().is_empty());
    assert!(w.volumes.mounted().is_empty());
    assert!(w.runtime.container_ids().is_empty());
}

/// A volume two tasks name stays mounted until the last of them lets it go: the first one's
/// release leaves it for the other (which found it mounted), whose container uses it. It used
/// to unmount it under the running task, whose writes then went to the root disk.
#[tokio::test(start_paused = true)]
async fn a_volume_two_tasks_hold_stays_mounted_until_the_last_lets_it_go() {
    let (w, engine) = World::with_engine(0).await;
    run(&engine, config("t1").with_data_volume()).await;
    run(&engine, config("t2").with_data_volume()).await;
    assert_eq!(w.volumes.mounted(), ["data"]);
    terminate_by_user(&engine, "t1").await;
    wait_released(&engine, "t1").await;
    engine.remove(&tid("t1")).await.unwrap();
    assert_eq!(w.volumes.mounted(), ["data"], "t2 runs with it");
    terminate_by_user(&engine, "t2").await;
    wait_released(&engine, "t2").await;
    engine.remove(&tid("t2")).await.unwrap();
    assert!(w.volumes.mounted().is_empty(), "the last one unmounts it");
}

/// Once t2 is letting go of the data volume (its stop or removal under way), `t1`'s container
/// exits and its release leaves the volume mounted: t2's container may still use it.
async fn t1_lets_the_volume_go_for_t2(w: &World, engine: &Engine, t1: &TaskInfo) {
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(w.runtime.exit(&t1.container_id, 0));
    wait_released(engine, "t1").await;
    let mounted = w.volumes.mounted();
    assert_eq!(mounted, ["data"], "t2's container may still use it");
}

/// A task terminated but whose container's stop is still under way holds its volume too: the
/// other task's release (its container exited) leaves the volume mounted for it.
#[tokio::test(start_paused = true)]
async fn a_volume_stays_mounted_while_another_tasks_stop_is_under_way() {
    let (w, engine) = World::with_engine(0).await;
    let t1 = run(&engine, config("t1").with_data_volume()).await;
    run(&engine, config("t2").with_data_volume()).await;
    w.runtime.hold_stops();
    let terminate = tokio::spawn({
        let engine = engine.clone();
        async move { terminate(&engine, "t2", "", Duration::from_secs(60)).await }
    });
    t1_lets_the_volume_go_for_t2(&w, &engine, &t1).await;
    w.runtime.release_stops();
    terminate.await.unwrap();
    wait_released(&engine, "t2").await;
    assert!(poll_until(30, TICK, async || w.volumes.mounted().is_empty()).await);
}

/// A removed task whose container is still being force-removed (its stop had failed: a
/// container stuck in the kernel holds the kill up) holds its volume too: the other task's
/// release leaves it mounted, and the last removal unmounts it. It used to count as let go as
/// soon as its remove began, and the volume was unmounted under its container.
#[tokio::test(start_paused = true)]
async fn a_volume_stays_mounted_while_another_tasks_container_is_being_removed() {
    let (w, engine) = World::with_engine(0).await;
    let t1 = run(&engine, config("t1").with_data_volume()).await;
    run(&engine, config("t2").with_data_volume()).await;
    w.runtime.set_unreachable(true);
    terminate_now(&engine, "t2", "the daemon is down").await;
    w.runtime.set_unreachable(false);
    w.runtime.hold_removes();
    let remove = spawn_remove(&engine, "t2");
    t1_lets_the_volume_go_for_t2(&w, &engine, &t1).await;
    w.runtime.release_removes();
    remove.await.unwrap().unwrap();
    assert!(w.volumes.mounted().is_empty(), "the last user unmounts it");
}

/// A second remove of a task while the first is carried out is refused (409): accepted, it
/// ran its own delete and forget, which could take the task submitted again under the same id
/// (its directory deleted, itself forgotten, its GPU left locked). Once the first is done, the
/// task is gone (404), and the one submitted again runs.
#[tokio::test(start_paused = true)]
async fn a_second_remove_while_the_first_runs_is_refused() {
    let (w, engine) = World::with_engine(1).await;
    let info = run(&engine, config("t1").with_gpus(1)).await;
    terminate_by_user(&engine, "t1").await;
    wait_released(&engine, "t1").await;
    let mut changes = engine.subscribe();
    w.runtime.hold_removes();
    let first = spawn_remove(&engine, "t1");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = tokio::time::timeout(Duration::from_secs(10), engine.remove(&tid("t1")))
        .await
        .expect("the second remove answers")
        .unwrap_err();
    assert_eq!(second.kind(), shim_engine::ErrorKind::Conflict, "{second}");
    w.runtime.release_removes();
    first.await.unwrap().unwrap();
    let gone = engine.remove(&tid("t1")).await.unwrap_err();
    assert_eq!(gone.kind(), shim_engine::ErrorKind::NotFound, "{gone}");
    let again = run(&engine, config("t1").with_gpus(1)).await;
    assert_eq!(again.container_name, info.container_name);
    assert!(w.task_json(&again.container_name).exists());
    let mut removed = 0;
    while let Some(Ok(change)) = changes.try_recv() {
        removed += usize::from(matches!(change.kind, ChangeKind::Removed));
    }
    assert_eq!(removed, 1);
}

/// A remove behind a release in flight waits for it (bounded), woken by the step that ends
/// the release rather than by polling, and then removes the task.
#[tokio::test(start_paused = true)]
async fn a_remove_behind_a_release_waits_for_it_then_removes() {
    let w = World::new(1);
    let engine = w.engine_with(|cfg| cfg.terminate_slack = SLACK).await;
    run(&engine, config("t1").with_data_volume()).await;
    w.volumes.hold_releases();
    terminate_now(&engine, "t1", "a held unmount").await;
    let remove = spawn_remove(&engine, "t1");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!remove.is_finished(), "the remove waits for the release");
    assert_eq!(w.volumes.mounted(), ["data"]);
    w.volumes.let_releases_go();
    tokio::time::timeout(Duration::from_secs(3), remove)
        .await
        .expect("the remove goes on once the release ends")
        .unwrap()
        .unwrap();
    assert!(engine.task_info(&tid("t1")).is_err());
    assert!(w.volumes.mounted().is_empty());
}

/// Makes every write of the task's state file fail, as a full disk does, without making the
/// directory unusable: `task.json` becomes a non-empty directory, which the atomic rename of a
/// new state file cannot replace.
fn break_state_file(w: &World, container_name: &str) {
    let state = w.task_json(container_name);
    fs_err::remove_file(&state).unwrap();
    fs_err::create_dir_all(state.join("blocker")).unwrap();
}

// Issue 22, SPEC §4: a failed state write never blocks a stop or a release. With the task's
// state file unwritable, terminate answers `terminated` with its reason at once, the container
// is stopped and everything it held released: GPUs, host keys, its volume. (The rest of a
// full disk, in every world, the convergence once it is freed included:
// `a_full_home_fails_writes_with_their_cause_and_converges_when_freed` in package shim-e2e.)
#[tokio::test(start_paused = true)]
async fn a_terminate_whose_write_fails_still_stops_and_releases() {
    let w = World::new(1);
    let engine = w.engine_with(|cfg| cfg.terminate_slack = SLACK).await;
    let c = config("t1").with_gpus(1).with_host_key().with_data_volume();
    let info = run(&engine, c).await;
    assert_eq!(engine.gpu_lock().locked().len(), 1);
    break_state_file(&w, &info.container_name);
    let answer = terminate_now(&engine, "t1", "an unwritable state file").await;
    // Terminated at once, the record waiting for the disk.
    assert_reason(&answer, "terminated_by_user");
    assert_eq!(answer.termination_message, "stop");
    assert_eq!(w.state_of(&info), Some(ContainerState::Exited));
    let release = FakeCall::Release("/fake/volumes/data".into());
    assert_called(&w.volumes.calls(), &release);
    assert!(engine.gpu_lock().locked().is_empty(), "GPUs released");
    assert!(w.keys.keys_of("ubuntu").is_empty(), "keys removed");
    assert!(w.volumes.mounted().is_empty());
    assert_eq!(read_state_file(&w, &info.container_name), None);
    engine.remove(&tid("t1")).await.unwrap();
    assert!(w.runtime.container_ids().is_empty());
}
