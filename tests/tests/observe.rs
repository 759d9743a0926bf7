//! End-to-end tests of the shim's observability (the binary, real Docker, HTTP): the live task
//! events of `GET /api/events`, the metrics of `GET /metrics` (parsed with a strict OpenMetrics
//! text parser) moving as a task runs, readiness, and JSON logs.
//!
//! Run: `SHIM_TEST_DOCKER=1 cargo nextest run -p shim-e2e --test observe --run-ignored all`
//! (the tests are ignored without `--run-ignored`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test code: a failed unwrap is a failed test; logs go to stderr"
)]

mod world;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use shim_e2e::harness::{EventStream, Metrics, Request, TestShim, wait_for};
use shim_e2e::{image, require_docker};

/// How long the event stream may stay silent before the test gives up (keep-alives come
/// every 15 s).
const EVENT_BOUND: Duration = Duration::from_secs(90);

/// A new home and the shim started on it with `extra` arguments (waits until it answers).
fn start(extra: &[&str]) -> TestShim {
    TestShim::builder("observe")
        .args(extra)
        .wait_answering()
        .start()
}

/// Submits a bridge-mode task of the local image with no GPU; answers the submit's answer
/// (a TaskInfo with upstream's Go field names).
fn submit(shim: &TestShim, id: &str) -> Value {
    let config = json!({
        "id": id, "name": format!("observe-{id}"), "image_name": image(),
        "gpu": 0, "network_mode": "bridge", "container_user": "root",
    });
    shim.submit(&config).ok()
}

/// The shim's event stream, connected (the snapshot is next).
fn events(shim: &TestShim) -> EventStream {
    EventStream::connect(shim.addr(), EVENT_BOUND).unwrap()
}

/// An SSE client sees a task from submit to removal: the snapshot first, then submitted,
/// each durable status (here only running), terminated with its reason, released,
/// removed — in order, with strictly increasing ids equal to each change's `seq`. A second
/// client that connects while the task runs gets it in its snapshot. The shim logs in JSON
/// (`--log-format json`): every line of `shim.log` is a JSON object, and lines about the task
/// carry its id in the `task` field.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn events_follow_a_task_from_submit_to_removal_and_json_logs() {
    require_docker();
    let shim = start(&["--log-format", "json"]);
    let mut sse = events(&shim);
    let snapshot = sse.next_event().unwrap();
    assert_eq!(snapshot.event, "snapshot");
    assert_eq!(snapshot.id, None);
    let snapshot: Value = serde_json::from_str(&snapshot.data).unwrap();
    assert_eq!(snapshot, json!({"tasks": []}));

    let id = shim.unique_id("events");
    let id = id.as_str();
    submit(&shim, id);
    let info = shim.wait_status(id, "running");
    let mut late = events(&shim);
    let late_snapshot: Value = serde_json::from_str(&late.next_event().unwrap().data).unwrap();
    assert_eq!(
        late_snapshot,
        json!({"tasks": [{"id": id, "status": "running"}]})
    );
    drop(late);
    shim.exit_runner(&info, 0);
    shim.wait_status(id, "terminated");
    shim.remove_retrying(id);

    let mut seen = Vec::new();
    let mut last_id = 0;
    loop {
        let event = sse.next_event().unwrap();
        assert_eq!(event.event, "change", "{event:?}");
        let data: Value = serde_json::from_str(&event.data).unwrap();
        let event_id = event.id.expect("a change has an id");
        assert!(
            event_id > last_id,
            "ids increase: {event_id} after {last_id}"
        );
        last_id = event_id;
        assert_eq!(data["seq"], event_id, "{data}");
        assert_eq!(data["task"], id, "{data}");
        assert!(data["time_ms"].as_u64().unwrap() > 0, "{data}");
        let change = data["change"].as_str().unwrap().to_owned();
        seen.push(match change.as_str() {
            "status" => data["status"].as_str().unwrap().to_owned(),
            "terminated" => format!(
                "terminated:{}",
                data["termination_reason"].as_str().unwrap()
            ),
            _ => change.clone(),
        });
        if change == "removed" {
            break;
        }
    }
    assert_eq!(
        seen,
        [
            "submitted",
            // `preparing`, `pulling` and `creating` pass with nothing to do (the image is
            // present): start progress, written with `running`, so never shown on their own.
            "running",
            "terminated:done_by_runner",
            "released",
            "removed"
        ]
    );

    // JSON logs: every line of shim.log is an object; the task's lines name it.
    let log = fs_err::read_to_string(shim.home().join("shim.log")).unwrap();
    let mut task_messages = BTreeSet::new();
    for line in log.lines() {
        let value: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line:?}"));
        let object = value.as_object().unwrap_or_else(|| panic!("{line}"));
        for key in ["timestamp", "level", "message", "target"] {
            assert!(object.contains_key(key), "{key} missing: {line}");
        }
        if object.get("task").and_then(Value::as_str) == Some(id) {
            task_messages.insert(object["message"].as_str().unwrap().to_owned());
        }
    }
    for message in ["task submitted", "task removed"] {
        assert!(
            task_messages.contains(message),
            "no {message:?} line with task={id}: {task_messages:?}"
        );
    }
}

/// Issue 28, part 4: each running task's usage in `/metrics`, read from its container's
/// control group: CPU seconds that rise while the container works, memory in use, OOM kills;
/// gone once the task ends.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn a_busy_task_shows_its_cpu_seconds_rise() {
    require_docker();
    let shim = start(&[]);
    let id = shim.unique_id("usage");
    let id = id.as_str();
    submit(&shim, id);
    let info = shim.wait_status(id, "running");
    let cid = info["container_id"].as_str().unwrap().to_owned();
    let task = [("task_id", id)];
    // The first scrape has the shim locate the container's group (in the background).
    let m = wait_for("the task's usage metrics", Duration::from_secs(5), || {
        let m = shim.metrics();
        let cpu = m.try_get("dstack_shim_task_cpu_seconds_total", &task);
        cpu.map(|_| m).ok_or_else(|| "not yet".to_owned())
    });
    let cpu_before = m.get("dstack_shim_task_cpu_seconds_total", &task);
    assert!(m.get("dstack_shim_task_memory_bytes", &task) > 0.0);
    assert_eq!(m.get("dstack_shim_task_oom_kills_total", &task), 0.0);
    assert_eq!(m.types["dstack_shim_task_cpu_seconds"], "counter");
    assert_eq!(m.types["dstack_shim_task_memory_bytes"], "gauge");
    // Work in the container (a process of its group): about a second of CPU.
    let out = shim_e2e::harness::docker(&[
        "exec",
        &cid,
        "sh",
        "-c",
        "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done",
    ]);
    assert!(out.status.success(), "{out:?}");
    let scraped = std::time::Instant::now();
    let m = shim.metrics();
    let scrape = scraped.elapsed();
    let cpu_after = m.get("dstack_shim_task_cpu_seconds_total", &task);
    eprintln!(
        "MEASURED task CPU seconds {cpu_before:.3} -> {cpu_after:.3} after a busy loop; scrape {scrape:?}"
    );
    assert!(
        cpu_after >= cpu_before + 0.2,
        "the busy loop's CPU shows: {cpu_before} -> {cpu_after}"
    );
    shim.exit_runner(&info, 0);
    shim.wait_status(id, "terminated");
    assert_eq!(
        shim.metrics()
            .try_get("dstack_shim_task_cpu_seconds_total", &task),
        None,
        "an ended task leaves the usage metrics"
    );
    shim.remove_retrying(id);
}

/// The metrics' documentation names every family the shim serves (docs/OPERATIONS.md).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn operations_md_lists_every_metric() {
    require_docker();
    let shim = start(&[]);
    let metrics = shim.metrics();
    let doc = fs_err::read_to_string(shim_e2e::repo_root().join("docs/OPERATIONS.md")).unwrap();
    for (family, typ) in &metrics.types {
        let sample = match typ.as_str() {
            "counter" => format!("{family}_total"),
            "info" => format!("{family}_info"),
            _ => family.clone(),
        };
        assert!(
            doc.contains(&format!("`{sample}`")) || doc.contains(&format!("`{sample}{{")),
            "docs/OPERATIONS.md does not list {sample}"
        );
    }
}

// The metrics move as tasks run: submitted, running, the GPUs locked, a create, the time to
// running; then the exit seen as a `die` event, the termination by reason and the time from
// exit to terminated, the GPUs free again; a remove leaves the counters; a second task moves
// them again. The families have their OpenMetrics types (the strict parser reads every scrape).
// The binary also answers `/api/ready` and names its build.
async fn metrics_move_as_tasks_run<W: world::World>() {
    let w = W::new(world::Options::default()).await;
    if let Some(shim) = w.binary() {
        let ready = shim.send(&Request::get("/api/ready"));
        assert_eq!(ready.status, 200, "{ready:?}");
        assert_has!(ready.json().unwrap(), {"ready": true, "events_connected": true});
        let version = shim.ok(&Request::get("/api/healthcheck"))["version"]
            .as_str()
            .unwrap()
            .to_owned();
        let build = shim.metrics();
        assert_eq!(build.types["dstack_shim_build"], "info");
        let info = build.get("dstack_shim_build_info", &[("version", &version)]);
        assert_eq!(info, 1.0);
    }
    // The figures that move, by name; `expected` names them in this order.
    let moving = |m: &Metrics| {
        let get = |name, labels: &[(&str, &str)]| m.get(name, labels);
        json!({
            "submitted": get("dstack_shim_tasks_submitted_total", &[]),
            "running": get("dstack_shim_tasks", &[("status", "running")]),
            "locked": get("dstack_shim_gpus_locked", &[]),
            "creates": get("dstack_shim_docker_requests_total", &[("op", "create")]),
            "exits": get("dstack_shim_exit_to_terminated_seconds_count", &[]),
        })
    };
    let expected = |submitted: f64, running: f64, locked: f64, creates: f64, exits: f64| {
        json!({"submitted": submitted, "running": running, "locked": locked, "creates": creates,
               "exits": exits})
    };

    let before = w.metrics().await;
    assert_eq!(before.types["dstack_shim_tasks_submitted"], "counter");
    let histogram = &before.types["dstack_shim_exit_to_terminated_seconds"];
    assert_eq!(histogram, "histogram");
    let gpus = before.get("dstack_shim_gpus_total", &[]);
    assert_eq!(gpus, world::GPUS as f64);
    assert_eq!(moving(&before), expected(0.0, 0.0, 0.0, 0.0, 0.0));

    let info = w.submitted("m1", 1, "running").await;
    let running = w.metrics().await;
    assert_eq!(moving(&running), expected(1.0, 1.0, 1.0, 1.0, 0.0));
    let to_running = running.get("dstack_shim_submit_to_running_seconds_count", &[]);
    assert_eq!(to_running, 1.0);

    w.exit_runner(&info, 0).await;
    w.wait_status("m1", "terminated").await;
    w.wait_all_gpus_free().await;
    let ended = w.metrics().await;
    // The wait for free GPUs submits probe tasks (one, or more when a probe came before the
    // release): every probe counts as submitted, the one that got the GPUs as a create (m1's
    // and the probe's).
    let probes = ended.get("dstack_shim_tasks_submitted_total", &[]) - 1.0;
    assert!(probes >= 1.0, "m1 and at least one GPU probe: {probes}");
    assert_eq!(moving(&ended), expected(1.0 + probes, 0.0, 0.0, 2.0, 1.0));
    let reason = [("reason", "done_by_runner")];
    let terminated = ended.get("dstack_shim_tasks_terminated_total", &reason);
    assert_eq!(terminated, 1.0);
    let dies = ended.get("dstack_shim_events_received_total", &[("kind", "die")]);
    assert!(dies >= 1.0, "{dies}");
    let reconciled = ended.try_get("dstack_shim_reconcile_last_success_age_seconds", &[]);
    assert!(reconciled.is_some());

    w.remove("m1").await;
    let removed = w.metrics().await;
    let terminated = removed.get("dstack_shim_tasks", &[("status", "terminated")]);
    assert_eq!(terminated, 0.0);
    let left = expected(1.0 + probes, 0.0, 0.0, 2.0, 1.0);
    assert_eq!(moving(&removed), left, "a remove leaves the counters");
    let info = w.submitted("m2", 0, "running").await;
    w.exit_runner(&info, 0).await;
    w.wait_status("m2", "terminated").await;
    w.remove("m2").await;
    let second = w.metrics().await;
    assert_eq!(moving(&second), expected(2.0 + probes, 0.0, 0.0, 3.0, 2.0));
    assert_eq!(second.get("dstack_shim_events_connected", &[]), 1.0);
}
in_worlds!(metrics_move_as_tasks_run: fake, docker, binary);
