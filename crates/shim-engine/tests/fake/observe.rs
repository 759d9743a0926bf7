//! What the engine shows: records and readiness on the injected clock, the change feed of fifty concurrent tasks, per-task usage in the metrics.

use super::*;

/// The injected clock is the engine's only wall clock: a record is stamped with the virtual
/// time of its submit and of its termination, and the readiness signal (the age of the last
/// full cycle) grows by exactly what the test advances: ten virtual minutes without a cycle
/// read as ten minutes, and a cycle brings the age back to zero.
#[tokio::test(start_paused = true)]
async fn records_and_readiness_follow_the_injected_clock() {
    let (w, engine) = World::with_engine(0).await;
    assert_eq!(engine.health().last_cycle_age, Some(Duration::ZERO));
    let submitted_at = w.clock.now_ms();
    assert!(submitted_at >= START_MS);
    run(&engine, config("t1")).await;
    let file = state_file(&w, "t1");
    assert_eq!(file["created_at_ms"], submitted_at, "{file}");

    let cycle_at = w.clock.now_ms();
    engine.reconcile_now().await;
    let ten_minutes = Duration::from_secs(600);
    tokio::time::advance(ten_minutes).await;
    let age = engine.health().last_cycle_age.unwrap();
    let expected = Duration::from_millis(w.clock.now_ms() - cycle_at);
    assert!((ten_minutes..=expected).contains(&age), "{age:?}");
    assert!(engine.health().is_ready(), "within the backstop's bound");
    let terminated_at = w.clock.now_ms();
    terminate(&engine, "t1", "bye", Duration::ZERO).await;
    let file = state_file(&w, "t1");
    assert_eq!(file["updated_at_ms"], terminated_at, "{file}");
    assert_eq!(file["created_at_ms"], submitted_at, "{file}");
    engine.reconcile_now().await;
    assert_eq!(engine.health().last_cycle_age, Some(Duration::ZERO));
}

/// A subscriber sees every change of 50 concurrent tasks exactly once, in order per task,
/// with increasing sequence numbers: submitted, each durable status, terminated, released,
/// removed.
#[tokio::test(start_paused = true)]
async fn subscribers_see_every_change_of_fifty_concurrent_tasks_in_order() {
    let (w, engine) = World::with_engine(0).await;
    let mut sub = engine.subscribe();
    let ids: Vec<String> = (0..50).map(|i| format!("c{i}")).collect();
    let submits = ids.iter().map(|id| engine.submit(config(id)));
    for r in futures_util::future::join_all(submits).await {
        r.unwrap();
    }
    for id in &ids {
        let info = wait_status(&engine, id, TaskStatus::Running).await;
        assert!(w.runtime.exit(&info.container_id, 0));
    }
    for id in &ids {
        wait_status(&engine, id, TaskStatus::Terminated).await;
        wait_released(&engine, id).await;
        engine.remove(&tid(id)).await.unwrap();
    }
    let mut seen: std::collections::BTreeMap<String, Vec<ChangeKind>> = Default::default();
    let mut last_seq = 0;
    while seen.values().map(Vec::len).sum::<usize>() < 50 * 5 {
        let change = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("a change is missing")
            .unwrap();
        assert!(change.seq > last_seq, "sequence numbers increase");
        last_seq = change.seq;
        seen.entry(change.task.to_string())
            .or_default()
            .push(change.kind);
    }
    assert!(sub.try_recv().is_none(), "no change twice");
    let status = |status| ChangeKind::Status { status };
    let expected = [
        ChangeKind::Submitted,
        // `preparing`, `pulling` and `creating` are start progress with nothing to do (no
        // GPU, the image present): never written on their own, so never shown.
        status(TaskStatus::Running),
        ChangeKind::Terminated {
            termination_reason: "done_by_runner".into(),
            termination_message: String::new(),
        },
        ChangeKind::Released,
        ChangeKind::Removed,
    ];
    assert_eq!(seen.len(), 50);
    for (id, changes) in &seen {
        assert_eq!(changes[..], expected[..], "{id}");
    }
}

// Issue 28, part 4: each running task's usage in `/metrics`, read from its container's
// control group (a cgroup v2 tree of the test's own here; the real engine's on a real
// container in the runtime-level e2e test). The group is located once per container (one
// inspect), then only its files are read; a task that stops running leaves the metrics.
#[tokio::test(start_paused = true)]
async fn running_tasks_show_their_cgroup_usage_in_the_metrics() {
    let w = World::new(0);
    let tree = tempfile::tempdir().unwrap();
    let (root, proc) = (tree.path().join("cgroup"), tree.path().join("proc"));
    let scope = "system.slice/docker-t.scope";
    let group = root.join(scope);
    fs_err::create_dir_all(&group).unwrap();
    fs_err::create_dir_all(proc.join("4242")).unwrap();
    fs_err::write(root.join("cgroup.controllers"), "cpu memory\n").unwrap();
    fs_err::write(proc.join("4242/cgroup"), format!("0::/{scope}\n")).unwrap();
    let set = |usec: u64, current: u64, peak: u64, ooms: u64| {
        for (file, text) in [
            ("cpu.stat", format!("usage_usec {usec}\n")),
            ("memory.current", format!("{current}\n")),
            ("memory.peak", format!("{peak}\n")),
            ("memory.events", format!("oom 0\noom_kill {ooms}\n")),
        ] {
            fs_err::write(group.join(file), text).unwrap();
        }
    };
    set(2_500_000, 1 << 20, 4 << 20, 0);
    let mut deps = w.deps();
    deps.cgroups = shim_resources::cgroup::Cgroups::at(&root, &proc);
    let engine = Engine::open(w.config(), deps).await.unwrap();
    let info = run(&engine, config("t-usage")).await;
    w.runtime.set_pid(&info.container_id, Some(4242));
    let usage = |text: &str, name: &str| sample(text, &format!("{name}{{task_id=\"t-usage\"}}"));
    let [cpu, memory, peak, ooms] = [
        "dstack_shim_task_cpu_seconds_total",
        "dstack_shim_task_memory_bytes",
        "dstack_shim_task_memory_peak_bytes",
        "dstack_shim_task_oom_kills_total",
    ];
    // The first scrape asks for the group; a later one shows the task.
    poll_until(500, TICK, async || usage(&scrape(&engine), cpu).is_some()).await;
    let text = scrape(&engine);
    let values = [cpu, memory, peak, ooms].map(|n| usage(&text, n));
    let expected = ["2.5", "1048576", "4194304", "0"].map(|v| Some(v.to_owned()));
    assert_eq!(values, expected, "{text}");
    let located_with = w.runtime.count("inspect");
    // The container works: its CPU seconds rise, an OOM kill is counted; no new inspect.
    set(4_000_000, 2 << 20, 4 << 20, 1);
    let text = scrape(&engine);
    let values = [cpu, ooms].map(|n| usage(&text, n));
    assert_eq!(values, [Some("4.0".into()), Some("1".into())], "{text}");
    assert_eq!(w.runtime.count("inspect"), located_with, "located once");
    // Once terminated, the task leaves the usage metrics.
    terminate_now(&engine, "t-usage", "usage").await;
    let text = scrape(&engine);
    assert_eq!(usage(&text, cpu), None, "{text}");
}

/// Terminations made while no shim ran count in `tasks_terminated_total` like those seen live:
/// an exit (judged by the first cycle) and a container gone (judged by restore itself); a task
/// already terminated on disk is not counted again.
#[tokio::test(start_paused = true)]
async fn terminations_decided_at_a_restart_are_counted_once() {
    let (mut w, engine) = World::with_engine(0).await;
    let exits = run(&engine, config("t1")).await;
    let vanishes = run(&engine, config("t2")).await;
    run(&engine, config("t3")).await;
    terminate(&engine, "t3", "bye", Duration::ZERO).await;
    shut_down(engine).await;
    assert!(w.runtime.exit_without_event(&exits.container_id, 3));
    assert!(w.runtime.vanish(&vanishes.container_id));
    let engine = w.fresh_process().await;
    wait_status(&engine, "t1", TaskStatus::Terminated).await;
    wait_status(&engine, "t2", TaskStatus::Terminated).await;
    let metrics = scrape(&engine);
    let counted = |reason: &str| {
        let name = format!(r#"dstack_shim_tasks_terminated_total{{reason="{reason}"}}"#);
        sample(&metrics, &name)
    };
    let exited = counted("container_exited_with_error");
    assert_eq!(exited.as_deref(), Some("1"), "{metrics}");
    assert_eq!(counted("executor_error").as_deref(), Some("1"), "{metrics}");
    assert_eq!(counted("terminated_by_user"), None, "{metrics}");
}
