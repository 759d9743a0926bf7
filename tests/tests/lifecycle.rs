//! A task's life: it runs, its runner's exit ends it, a terminate stops it, one scenario in
//! every world (see `world/mod.rs`); then the HTTP API of SPEC §3 as the dstack server drives
//! the built binary: the healthcheck's version, a whole lifecycle, bad input refused, what
//! upstream accepts, and a real dstack server's SSH fleet.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use shim_e2e::harness::{
    ContainerSweeper, FAKE_GPUS, HostUser, RUNNER_HTTP_PORT, Request, Response, ShimProcess,
    TestShim, assert_running, container_running, entries, fake_gpu_ids, free_port, pending_info,
    published_ports, runner_dir, server_task, shim_binary, ssh_key, task_entries,
    wait_container_stopped, wait_for, wait_until,
};
use shim_e2e::{
    docker_ok, dstack_python, repo_root, require_docker, require_docker_and_root, runner_path,
};

use world::{Options, World, cid, gpu_ids};

// SPEC §2, §4: a task runs with the runner's two ports published (bridge network) and its
// GPU, held in its state file (`running` is not written on its own: the container proves it,
// SPEC §5); the runner's exit ends it by its code: 0 →
// `done_by_runner` with no message, 3 → `container_exited_with_error` with the container's
// last five log lines. The exit event is enough (the engine's relist period is an hour in the
// engine worlds). Its resources are released, recorded as released, and its GPU is free again.
async fn a_runners_exit_ends_the_task_by_its_code<W: World>() {
    let w = W::new(Options::default()).await;
    let [ok, bad] = w.all_running([("ok", 1), ("bad", 0)]).await;
    let ports = ok["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 2, "the runner's http and ssh ports: {ok}");
    assert!(ports.iter().all(|p| p["host"].as_u64() > Some(0)), "{ok}");
    assert_eq!(ok["gpus_ids"].as_array().unwrap().len(), 1, "{ok}");
    w.wait_state_file(&ok, "holds its GPU, running not written", |f| {
        f["rust_shim"]["resources"]["gpus"].as_array().map(Vec::len) == Some(1)
            && f["rust_shim"]["status"] != "running"
    })
    .await;
    if let Some(fake) = w.fake() {
        // The container carries this shim's labels.
        let spec = fake.spec(ok["container_id"].as_str().unwrap()).unwrap();
        assert_eq!(spec.labels["ai.dstack.shim.task-id"], "ok");
        assert_eq!(spec.labels["ai.dstack.shim.owner"], w.owner());
    }

    w.exit_runner(&ok, 0).await;
    let done = w.wait_status("ok", "terminated").await;
    assert_has!(done, {"termination_reason": "done_by_runner", "termination_message": ""});

    w.exit_runner(&bad, 3).await;
    let failed = w.wait_status("bad", "terminated").await;
    assert_has!(failed, {"termination_reason": "container_exited_with_error"});
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

// SPEC §4: the exit code is the container's, whatever its image's labels say. Docker copies a
// container's labels (its image's among them) into the `die` event after `exitCode` (moby
// daemon/events.go, `LogContainerEventWithAttributes`), so an image labelled `exitCode=0`
// made a runner's exit 3 read `done_by_runner`, kept for good. (Docker only: the fake engine's
// events carry the code apart from the labels, and Podman sets its own after them.)
async fn an_images_exit_code_label_names_no_exit<W: World>() {
    let w = W::new(Options::default()).await;
    let donor = w.submitted("donor", 0, "running").await;
    let cid = donor["container_id"].as_str().unwrap();
    let image = w
        .commit(cid, &[("exitCode", "0"), ("containerExitCode", "0")])
        .await;
    w.finish("donor").await;
    let mut task = w.task("labelled", 0);
    task["image_name"] = image.reference.clone().into();
    w.submit(&task).await.unwrap();
    let running = w.wait_status("labelled", "running").await;
    w.exit_runner(&running, 3).await;
    let failed = w.wait_status("labelled", "terminated").await;
    assert_has!(failed, {"termination_reason": "container_exited_with_error"});
    w.finish("labelled").await;
}
in_worlds!(an_images_exit_code_label_names_no_exit: docker, binary);

// SPEC §4: terminate stops a running task and answers once it is stopped. Timeout 0 is
// `docker stop -t 0` (upstream: runner/internal/shim/docker.go, Terminate: ContainerStop with
// the request's timeout): SIGTERM then SIGKILL at once, so the stub runner (which traps
// SIGTERM) ends 143 or 137; with a grace period it exits on its own (143), well before it
// ends. A second terminate keeps the first reason and message, and so does the exit the
// stop caused (a relist judges nothing again). Its GPU is released; remove deletes the
// container.
async fn terminate_stops_a_running_task_and_keeps_the_first_reason<W: World>() {
    let w = W::new(Options::default()).await;
    let [now, grace] = w.all_running([("now", 1), ("grace", 0)]).await;
    let (now_cid, grace_cid) = (cid(&now), cid(&grace));

    let info = w
        .terminate("now", "terminated_by_user", "stop now", 0)
        .await;
    assert_has!(info, {"status": "terminated", "termination_reason": "terminated_by_user"});
    let code = w.container_exit_code(now_cid).await;
    assert!(matches!(code, Some(137 | 143)), "exit code {code:?}");

    let info = w
        .terminate("grace", "terminated_by_server", "stop nicely", 10)
        .await;
    assert_has!(info, {"termination_reason": "terminated_by_server"});
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
    let first = "stop now";
    assert_has!(again, {"termination_reason": "terminated_by_user", "termination_message": first});
    assert_ne!(w.relist().await, Some(false), "a relist fails");
    assert_has!(w.info("grace").await.unwrap(), {"termination_message": "stop nicely"});

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
        assert_has!(info, {"status": "terminated", "termination_reason": "terminated_by_user"});
        if let Err(e) = w.try_remove(&id).await {
            refused.push(format!("{id}: {e}"));
            w.remove(&id).await;
        }
    }
    assert_eq!(refused, [""; 0], "removes refused after terminate");
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

// SPEC §3–§4: only an ended task can be removed (a running one is refused, 409, and runs on);
// a remove deletes the task's container and directory and forgets it (a second remove: 404);
// its id can then be submitted again, once (a second submit of it: 409).
async fn a_remove_is_for_ended_tasks_and_leaves_nothing<W: World>() {
    let w = W::new(Options::default()).await;
    let task = w.task("rm", 0);
    w.submit(&task).await.unwrap();
    let info = w.wait_status("rm", "running").await;
    let cid = info["container_id"].as_str().unwrap();
    let refused = w.try_remove("rm").await.unwrap_err();
    assert!(
        w.binary().is_none() || refused.starts_with("409"),
        "{refused}"
    );
    assert_eq!(w.info("rm").await.unwrap()["status"], "running");
    assert_eq!(w.container_running(cid).await, Some(true));

    w.terminate("rm", "terminated_by_user", "", 0).await;
    assert!(w.state_file(&info).is_some(), "kept until removed");
    w.remove("rm").await;
    assert!(w.info("rm").await.is_none());
    assert_eq!(w.container_running(cid).await, None, "container removed");
    let name = info["container_name"].as_str().unwrap();
    let dir = w.home().join("runners").join(name);
    assert!(!dir.exists(), "the task's directory is removed");
    let gone = w.try_remove("rm").await.unwrap_err();
    assert!(gone.starts_with("404"), "{gone}");

    w.submit(&task).await.unwrap();
    let twice = w.submit(&task).await.unwrap_err();
    assert!(
        twice.starts_with("409") && twice.contains("already exists"),
        "{twice}"
    );
    w.wait_started_or_ended("rm").await;
    w.finish("rm").await;
    assert_eq!(w.containers().await, 0);
}
in_worlds!(a_remove_is_for_ended_tasks_and_leaves_nothing: fake, docker, binary);

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
    let info = w
        .poll("no pull progress", async || {
            let info = w.info("pull").await.unwrap();
            let downloaded = info["image_pull_progress"]["downloaded_bytes"].as_u64();
            if downloaded > Some(0) {
                Ok(info)
            } else {
                Err(info.to_string())
            }
        })
        .await;
    assert_has!(info, {"status": "pulling"});
    let done = w.terminate("pull", "terminated_by_user", "", 0).await;
    assert_has!(done, {"status": "terminated", "termination_reason": "terminated_by_user"});
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

// ---------------------------------------------------------------------------------------------
// The binary only (real Docker, HTTP; ignored unless run with `--run-ignored all`)
// ---------------------------------------------------------------------------------------------

/// Bounds of the waits (never timed assertions: generous, only there so a hang fails).
const START_BOUND: Duration = Duration::from_secs(60);
const STATUS_BOUND: Duration = Duration::from_secs(90);

/// SPEC §2–§4, the whole life of a task over HTTP: the healthcheck names the service and the
/// one version string, which `--version` shows too; instance info shows the (fake) NVIDIA GPUs;
/// submit answers the exact pending TaskInfo; the task runs with published ports (the runner
/// answers through them) and its GPUs; the list shows it; the runner exits 0 →
/// `done_by_runner`; a later terminate keeps that reason; remove deletes the container and the
/// task directory; the task is then unknown. What the dstack server makes of the version
/// string (every feature gate on from 0.21.3, no reinstall, no restart) is checked against its
/// own code by `started_as_ssh_fleets_start_it_the_dstack_server_keeps_it`.
///
/// dstack server: src/dstack/_internal/server/services/runner/client.py (ShimClient: version
/// gates), src/dstack/_internal/server/background/pipeline_tasks/instances/check.py
/// (_maybe_install_components: compares the installed and running versions).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn full_lifecycle_over_http() {
    require_docker();
    let shim = TestShim::builder("e2e").start();
    // The healthcheck's version is a compatible release (the healthcheck and instance info
    // answered with no task yet).
    let health = shim.get("/api/healthcheck").ok();
    let version = health["version"].as_str().expect("version is a string");
    let release = format!(
        "{}+rust.{}",
        shim_e2e::DSTACK_VERSION,
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(
        health,
        json!({"service": "dstack-shim", "version": release})
    );
    let info = shim.get("/api/instance/info").ok();
    let fake = json!({"gpu_vendor": "nvidia", "gpu_driver_version": "0.0.0-fake"});
    assert_eq!(info, fake);
    let out = Command::new(shim_binary()).arg("--version").output();
    let out = out.unwrap();
    assert!(out.status.success());
    // One version string: what the components list reads from `--version` is what the
    // healthcheck answers (the server restarts a shim whose two strings differ).
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text, format!("dstack-shim version {version}\n"));
    let components = shim.get("/api/components").ok();
    assert_has!(components["components"][1], {"version": version}, "{components}");
    assert_eq!(shim.list(), BTreeMap::new());

    let key = ssh_key("e2e@lifecycle");
    let mut config = server_task("life-1", 2);
    config["container_ssh_keys"] = json!([key]);
    let submitted = shim.submit(&config).ok();
    assert_eq!(submitted, pending_info(&config));
    // The state file exists before the 200 (SPEC §4), outside the mounted runner directory.
    assert!(shim.task_dir("life-1").join("task.json").is_file());

    let info = shim.wait_status("life-1", "running");
    assert_running(&info, &config, 2);
    let cid = info["container_id"].as_str().unwrap().to_owned();
    assert_eq!(
        shim.list(),
        BTreeMap::from([("life-1".to_owned(), "running".to_owned())])
    );

    // The runner's HTTP port is reachable through the published host port.
    let runner_addr = SocketAddr::from(([127, 0, 0, 1], published_ports(&info)[&RUNNER_HTTP_PORT]));
    // docker-proxy accepts before the runner listens: retry, bounded.
    let health = wait_for("the runner answers", STATUS_BOUND, || {
        match Request::get("/api/healthcheck").send(runner_addr) {
            Ok(r) if r.status == 200 => Ok(r.body),
            other => Err(format!("{other:?}")),
        }
    });
    assert!(health.contains("\"dstack-runner\""), "{health}");
    // The container SSH key reached the runner's command line.
    let args =
        fs_err::read_to_string(runner_dir(shim.home(), &info).join("stub-runner.args")).unwrap();
    assert!(
        args.contains(&format!("--ssh-authorized-key\n{key}\n")),
        "{args}"
    );

    shim.exit_runner(&info, 0);
    let done = shim.wait_status("life-1", "terminated");
    assert_has!(done, {"termination_reason": "done_by_runner", "termination_message": "",
                       "container_id": cid});
    assert_eq!(container_running(None, &cid), Some(false));
    assert_eq!(
        shim.list(),
        BTreeMap::from([("life-1".to_owned(), "terminated".to_owned())])
    );

    // The server always sends terminate, also for ended tasks: the first reason is kept.
    let again = shim
        .terminate("life-1", "terminated_by_server", "too late", 0)
        .ok();
    assert_has!(again, {"status": "terminated", "termination_reason": "done_by_runner",
                        "termination_message": ""});

    // Its GPUs were released: a task wanting all four gets them.
    let all = server_task("life-2", FAKE_GPUS as i64);
    shim.submit(&all).ok();
    let info2 = shim.wait_status("life-2", "running");
    assert_eq!(gpu_ids(&info2), fake_gpu_ids(), "{info2}");
    shim.finish("life-2");

    shim.remove("life-1").assert_empty_ok();
    shim.get("/api/tasks/life-1").assert_error(404, "Not Found");
    assert_eq!(
        container_running(None, &cid),
        None,
        "the container was removed"
    );
    assert!(!shim.task_dir("life-1").exists());
    assert_eq!(task_entries(&shim.tasks_dir()), BTreeSet::new());
    assert_eq!(shim.list(), BTreeMap::new());
    assert_eq!(shim.container_ids(), BTreeSet::new());
}

/// SPEC §2, §3: bad input is refused with the right status and a readable message, and
/// changes nothing: the task list, the home and the tasks directory, and the shim's
/// containers are the same afterwards; the running task is untouched.
///
/// The messages are upstream's: the body decoding ones from
/// `runner/internal/common/api/api.go` (`DecodeJSONBody`), the missing fields from
/// `runner/internal/shim/api/handlers.go` (`"empty id"`, `"empty name"`, `"empty image_name"`),
/// the unknown route and method from Go's `net/http` `ServeMux` (`404 page not found`,
/// `Method Not Allowed`).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn bad_input_is_refused_and_changes_nothing() {
    require_docker();
    let shim = TestShim::builder("e2e").start();
    let good_key = ssh_key("e2e@bad-input");
    let mut running = server_task("ok-1", 1);
    running["container_ssh_keys"] = json!([good_key]);
    shim.submit(&running).ok();
    let before = shim.wait_status("ok-1", "running");
    let cid = before["container_id"].as_str().unwrap().to_owned();

    // The list, the task directories, the home, what is beside it, the containers.
    let state = || {
        let mut home = entries(shim.home());
        home.remove("host_info.json"); // written once in the background after start
        let tasks = task_entries(&shim.tasks_dir());
        (
            shim.list(),
            tasks,
            home,
            entries(shim.root()),
            shim.container_ids(),
        )
    };
    let before_all = state();
    let unchanged = |what: &str| {
        let what = format!("{what}: (list, task directories, home, beside it, containers)");
        assert_eq!(state(), before_all, "{what}");
    };

    let submit_with = |field: &str, value: Value| {
        let mut config = server_task("bad-1", 0);
        config[field] = value;
        config
    };
    let without = |field: &str| {
        let mut config = server_task("bad-1", 0);
        config.as_object_mut().unwrap().remove(field);
        config
    };

    // Malformed bodies, content types, sizes; fields missing or out of range.
    let post =
        |content_type: &str, body: &[u8]| shim.post_raw("/api/tasks", Some(content_type), body);
    let (json_type, valid) = ("application/json", server_task("bad-1", 0).to_string());
    let chunked = Request::post("/api/tasks").chunked_body(Some(json_type), big_config());
    let cases: Vec<(&str, Response, u16, &str)> = vec![
        (
            "malformed JSON",
            post(json_type, b"{\"id\": \"x\", "),
            400,
            "Request body contains badly-formed JSON",
        ),
        (
            "trailing data",
            post(json_type, format!("{valid} {{}}").as_bytes()),
            400,
            "Request body must only contain a single JSON object",
        ),
        (
            "empty body",
            post(json_type, b""),
            400,
            "Request body must not be empty",
        ),
        (
            "a JSON array",
            post(json_type, b"[1]"),
            400,
            "Request body contains an invalid value for the \"\" field (at position 1)",
        ),
        (
            "wrong content type",
            post("text/plain", valid.as_bytes()),
            415,
            "Content-Type header is not application/json",
        ),
        (
            "form content type",
            post("application/x-www-form-urlencoded", b"id=bad-1"),
            415,
            "Content-Type header is not application/json",
        ),
        (
            "body over 1 MiB (Content-Length)",
            post(json_type, &big_config()),
            413,
            "Request body must not be larger than 1MB",
        ),
        (
            "body over 1 MiB (chunked)",
            shim.send(&chunked),
            413,
            "Request body must not be larger than 1MB",
        ),
        ("missing id", shim.submit(&without("id")), 400, "empty id"),
        (
            "missing name",
            shim.submit(&without("name")),
            400,
            "empty name",
        ),
        (
            "missing image_name",
            shim.submit(&without("image_name")),
            400,
            "empty image_name",
        ),
        (
            "empty image_name",
            shim.submit(&submit_with("image_name", json!(""))),
            400,
            "empty image_name",
        ),
        (
            "gpu -2",
            shim.submit(&submit_with("gpu", json!(-2))),
            400,
            "invalid task config: gpu: must be -1 (all), 0 or a positive count",
        ),
        (
            "memory -1",
            shim.submit(&submit_with("memory", json!(-1))),
            400,
            "invalid task config: memory: must be >= 0",
        ),
        (
            "relative instance mount",
            shim.submit(&submit_with(
                "instance_mounts",
                json!([{"instance_path": "rel/dir", "path": "/data"}]),
            )),
            400,
            "invalid task config: instance_mounts[0].instance_path: \"rel/dir\" is not an absolute path",
        ),
    ];
    for (what, resp, status, message) in &cases {
        resp.assert_error(*status, message);
        unchanged(what);
    }
    shim.submit(&submit_with("network_mode", json!("overlay")))
        .assert_error_starts(
            400,
            "Request body contains an invalid value for the \"network_mode\" field",
        );
    unchanged("network mode overlay");

    // Ids and names that must never become a path or a container name.
    let long = "a".repeat(129);
    let max = "b".repeat(128);
    for bad in [
        "a/b",
        "..",
        "../escape",
        "a b",
        ".hidden",
        "-dash",
        "",
        long.as_str(),
    ] {
        for field in ["id", "name"] {
            let resp = shim.submit(&submit_with(field, json!(bad)));
            if bad.is_empty() {
                // Upstream's message for an empty id or name.
                resp.assert_error(400, &format!("empty {field}"));
            } else {
                resp.assert_error_starts(
                    400,
                    &format!("Request body contains an invalid value for the {field:?} field"),
                );
                assert!(
                    resp.body
                        .contains(&format!(": {field} {bad:?} is invalid: ")),
                    "{field} {bad:?}: {resp:?}"
                );
            }
            unchanged(&format!("{field} {bad:?}"));
        }
    }
    // 128 characters is still fine for a name (the positive control of the length rule).
    let mut long_name = server_task("ok-long", 0);
    long_name["name"] = json!(max);
    assert_eq!(shim.submit(&long_name).ok(), pending_info(&long_name));
    // Terminated only once running: terminate during start has its own (bug) tests below.
    shim.wait_status("ok-long", "running");
    shim.finish("ok-long");
    unchanged("a 128-character name, submitted and removed");

    // SSH keys: any line the server sends is accepted at submit, as upstream does (a host key
    // that is not one plain OpenSSH key is skipped at start), but never one that could inject
    // a second line into authorized_keys or the runner's command line.
    let bad_keys = [
        ("a line break", format!("{good_key}\n{}", ssh_key("second"))),
        ("a carriage return", format!("{good_key}\r")),
        ("a NUL", format!("{good_key}\0")),
    ];
    for (what, key) in &bad_keys {
        for (field, extra) in [
            ("container_ssh_keys", None),
            ("host_ssh_keys", Some(("host_ssh_user", "root"))),
        ] {
            let mut config = submit_with(field, json!([key]));
            if let Some((f, v)) = extra {
                config[f] = json!(v);
            }
            let resp = shim.submit(&config);
            resp.assert_error_starts(
                400,
                &format!("Request body contains an invalid value for the \"{field}.0\" field"),
            );
            assert!(
                resp.body.contains(": invalid SSH public key "),
                "{field} with {what}: {resp:?}"
            );
            unchanged(&format!("{field} with {what}"));
        }
    }

    // Unknown tasks: 404 everywhere, with upstream's messages; an id in the path that is not
    // a valid id names no task: 404 too (upstream: runner/internal/shim/api/handlers.go).
    shim.get("/api/tasks/nope").assert_error(404, "Not Found");
    shim.terminate("nope", "terminated_by_user", "", 0)
        .assert_error(404, "task nope: not found");
    shim.remove("nope")
        .assert_error(404, "task nope: not found");
    unchanged("unknown task");
    shim.get("/api/tasks/...").assert_error(404, "Not Found");
    shim.remove("a%2Fb")
        .assert_error(404, "task a/b: not found");
    shim.terminate("-x", "terminated_by_user", "", 0)
        .assert_error(404, "task -x: not found");
    unchanged("invalid ids in the path");

    // Remove of a running task: 409, and it still runs.
    shim.remove("ok-1").assert_error_starts(409, "");
    let still = shim.info("ok-1");
    assert_running(&still, &running, 1);
    assert_eq!(still["container_id"], cid.as_str());
    unchanged("remove of a running task");

    // A duplicate id: 409, whatever else the config says; the first task is untouched.
    shim.submit(&running).assert_error_starts(409, "");
    let mut other = server_task("ok-1", 0);
    other["name"] = json!("another-name");
    shim.submit(&other).assert_error_starts(409, "");
    assert_eq!(shim.info("ok-1"), before);
    unchanged("duplicate id");

    // Unknown routes and methods.
    shim.get("/api/nothing-here")
        .assert_error(404, "404 page not found");
    shim.get("/api/shutdown")
        .assert_error(405, "Method Not Allowed");
    unchanged("unknown routes");

    let messages: Vec<String> = [
        shim.remove("ok-1"),
        shim.submit(&running),
        shim.get("/api/nothing-here"),
        shim.get("/api/shutdown"),
    ]
    .iter()
    .map(|r| format!("{} {}", r.status, r.body))
    .collect();
    eprintln!("error messages: {messages:#?}");
    for m in &messages {
        assert!(m.len() > 10, "a readable message: {m:?}");
    }

    shim.finish("ok-1");
    assert_eq!(shim.container_ids(), BTreeSet::new());
}

/// A valid task config padded past 1 MiB with an unknown field.
fn big_config() -> Vec<u8> {
    let mut config = server_task("big-1", 0);
    config["padding"] = json!("x".repeat(1024 * 1024 + 1));
    serde_json::to_vec(&config).unwrap()
}

/// Issue 11: what upstream accepts is accepted. The server sends the keys of users' files
/// "without any validation": a host key with options, a certificate and a garbage line are
/// accepted (200), skipped at start and logged, and never written (the valid key is); a
/// `gcp` volume without `device_name` and a backend this shim cannot attach are accepted and
/// end the task at start with `executor_error` naming the volume (a 400 would make the server
/// retry for ten minutes); an image name with whitespace ends it with the pull's error. The probes of `bad_input_is_refused_and_changes_nothing` still
/// refuse.
///
/// upstream: runner/internal/shim/docker.go (Run: host keys appended without checks;
/// prepareVolumes: GetBackend fails the task), runner/internal/shim/backends/backends.go.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn what_upstream_accepts_is_accepted_and_ends_as_upstream_ends_it() {
    require_docker_and_root(); // HostUser runs useradd: root.
    let shim = TestShim::builder("e2e").start();
    let own = ssh_key("own@host");
    let user = HostUser::create(shim.root());
    user.add_line(&own);
    let good = ssh_key("e2e@accepted");
    let optioned = format!("no-pty,command=\"/bin/false\" {}", ssh_key("e2e@optioned"));
    let cert = ssh_key("e2e@cert").replacen("ssh-ed25519 ", "ssh-ed25519-cert-v01@openssh.com ", 1);
    let mut keys = server_task("keys-1", 0);
    keys["host_ssh_user"] = json!(user.name());
    keys["host_ssh_keys"] = json!([optioned, cert, "not a key at all", good]);
    keys["container_ssh_keys"] = json!([cert, good]);
    assert_eq!(shim.submit(&keys).ok(), pending_info(&keys));
    shim.wait_status("keys-1", "running");
    let lines = user.lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], own);
    assert!(
        lines[1].starts_with(&good) && lines[1].ends_with("# added by dstack-shim"),
        "{lines:?}"
    );
    let log = fs_err::read_to_string(shim.log_path(1)).unwrap();
    assert_eq!(
        log.matches("host SSH key skipped").count(),
        3,
        "each skipped key is logged"
    );

    let mut gcp = server_task("gcp-1", 0);
    gcp["volumes"] =
        json!([{"backend": "gcp", "name": "disk-1", "volume_id": "v1", "init_fs": true}]);
    gcp["volume_mounts"] = json!([{"name": "disk-1", "path": "/data"}]);
    let mut azure = server_task("azure-1", 0);
    azure["volumes"] = json!([{"backend": "azure", "name": "disk-2", "volume_id": "v2", "init_fs": false, "device_name": "sdb"}]);
    for (config, volume) in [(&gcp, "disk-1"), (&azure, "disk-2")] {
        let id = config["id"].as_str().unwrap();
        assert_eq!(shim.submit(config).ok(), pending_info(config));
        let ended = shim.wait_status(id, "terminated");
        assert_has!(ended, {"termination_reason": "executor_error", "container_id": ""});
        let message = ended["termination_message"].as_str().unwrap();
        assert!(message.contains(volume), "names the volume: {message:?}");
        shim.remove_retrying(id);
    }

    // An image name with a stray space (pasted from a web page) is the engine's to refuse,
    // as upstream leaves it: the task ends with the pull's error.
    let mut spaced = server_task("spaced-1", 0);
    spaced["image_name"] = json!(format!("{} ", spaced["image_name"].as_str().unwrap()));
    assert_eq!(shim.submit(&spaced).ok(), pending_info(&spaced));
    let ended = shim.wait_status("spaced-1", "terminated");
    assert_has!(ended, {"termination_reason": "creating_container_error"});
    shim.remove_retrying("spaced-1");

    shim.finish("keys-1");
    assert_eq!(user.lines(), [own]);
    assert_eq!(shim.container_ids(), BTreeSet::new());
}

/// Issue 11, as an SSH fleet starts the shim and a dstack 0.22.5 server checks it: every
/// setting from upstream's environment variables (no flag at all; `DSTACK_SERVICE_MODE="1"`
/// as the server writes it into `shim.env`), host_info.json written, the settings in effect
/// in a task's container; then the server's own code (PyPI `dstack[server]==0.22.5`, the venv
/// `cargo xtask dev-env` makes) negotiates API v2 with every feature gate on and, as a
/// release server and as one without a version, requests no install and no shutdown.
///
/// upstream: runner/cmd/shim/main.go (the flags' environment variables),
/// src/dstack/_internal/server/services/ssh_fleets/provisioning.py (shim.env,
/// DSTACK_SERVICE_MODE), runner/internal/shim/host_info.go.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn started_as_ssh_fleets_start_it_the_dstack_server_keeps_it() {
    require_docker();
    let python = dstack_python();
    assert!(
        python.exists(),
        "{} is missing: run `cargo xtask dev-env` (it installs dstack[server]=={} in a venv) or \
         set {}",
        python.display(),
        shim_e2e::DSTACK_VERSION,
        shim_e2e::ENV_DSTACK_PYTHON
    );
    let root = tempfile::Builder::new()
        .prefix("shim-e2e-env-")
        .tempdir()
        .unwrap();
    let home = std::path::absolute(root.path().join("home")).unwrap();
    let _sweeper = ContainerSweeper::for_home(&home);
    let (port, dcgm_port) = (free_port().unwrap(), free_port().unwrap());
    let (http_port, ssh_port) = (11999_u16, 11022_u16);
    let (shim_path, runner) = (shim_binary(), runner_path());
    let (home_dir, shim_path, runner) = (home.display(), shim_path.display(), runner.display());
    let release = shim_e2e::DSTACK_VERSION;
    // One `NAME=value` a line, as in `shim.env`. The runner is not fetched: it is there
    // already (as upstream: installed only if missing). The stub runner reports the server's
    // release (`STUB_RUNNER_VERSION`), as an installed runner would.
    let env = format!(
        "DSTACK_SHIM_HOME={home_dir}
         DSTACK_SHIM_BINARY_PATH={shim_path}
         DSTACK_SHIM_HTTP_PORT={port}
         DSTACK_SHIM_LOG_LEVEL=5
         DSTACK_RUNNER_DOWNLOAD_URL=http://127.0.0.1:9/dstack-runner
         DSTACK_RUNNER_BINARY_PATH={runner}
         DSTACK_RUNNER_HTTP_PORT={http_port}
         DSTACK_RUNNER_SSH_PORT={ssh_port}
         DSTACK_RUNNER_SSH_LOG_LEVEL=debug
         DSTACK_RUNNER_LOG_LEVEL=5
         DSTACK_DCGM_EXPORTER_HTTP_PORT={dcgm_port}
         DSTACK_DCGM_EXPORTER_INTERVAL=5000
         DSTACK_DCGM_ADDRESS=
         DSTACK_DOCKER_PASS_ENV=E2E_PASSED,E2E_UNSET
         DSTACK_DOCKER_PRIVILEGED=0
         PJRT_DEVICE=TPU
         DSTACK_SERVICE_MODE=1
         E2E_PASSED=yes
         STUB_RUNNER_VERSION={release}"
    );
    let mut command = Command::new(shim_binary());
    command
        .env_remove("RUST_LOG")
        .env_remove("E2E_UNSET")
        .env("NO_COLOR", "1")
        .envs(env.lines().map(|l| l.trim().split_once('=').unwrap()));
    let log = root.path().join("shim.log");
    let mut shim = ShimProcess::from_command(command, port, &log).unwrap();
    let dump = |what: &str| format!("{what}\n{}", shim_e2e::harness::tail(&log, 80));
    shim.wait_answering(START_BOUND, Duration::from_millis(20))
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = shim.addr();
    let get = |path: &str| Request::get(path).send(addr).unwrap().ok();

    // host_info.json, as upstream computes it.
    let host_info = home.join("host_info.json");
    wait_until("host_info.json is written", STATUS_BOUND, || {
        host_info.exists()
    });
    let info = world::read_json(&host_info);
    for f in ["cpus", "memory", "disk_size"] {
        // disk_size: Docker's root directory is readable.
        assert!(info[f].as_u64().unwrap() > 0, "{f}: {info}");
    }
    let addresses = info["addresses"].as_array().unwrap();
    assert!(!addresses.is_empty(), "{info}");
    assert!(
        addresses
            .iter()
            .all(|a| !a.as_str().unwrap().starts_with("127.") && a != "::1/128"),
        "no loopback address: {info}"
    );

    // One version string; the runner's version read from the binary the variable names.
    let version = get("/api/healthcheck")["version"]
        .as_str()
        .unwrap()
        .to_owned();
    let components = get("/api/components");
    let by_name = |name: &str| {
        components["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("{components}"))
            .clone()
    };
    assert_has!(by_name("dstack-shim"), {"version": version}, "{components}");
    assert_has!(by_name("dstack-runner"), {"version": release}, "{components}");

    // The settings in effect in a task's container.
    let config = server_task("env-1", 0);
    let submitted = Request::post("/api/tasks")
        .json(&config)
        .send(addr)
        .unwrap();
    assert_eq!(submitted.status, 200, "{}", dump(&format!("{submitted:?}")));
    let every = Duration::from_millis(50);
    let running = shim
        .api()
        .wait_status("env-1", "running", every, STATUS_BOUND);
    let (running, _) = running.unwrap_or_else(|e| panic!("{}", dump(&e.to_string())));
    assert_eq!(
        published_ports(&running)
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        [ssh_port, http_port],
        "{running}"
    );
    let cid = running["container_id"].as_str().unwrap();
    let container_env: Vec<String> =
        serde_json::from_str(&docker_ok(&["inspect", "-f", "{{json .Config.Env}}", cid])).unwrap();
    for wanted in ["PJRT_DEVICE=TPU", "E2E_PASSED=yes"] {
        assert!(
            container_env.iter().any(|e| e == wanted),
            "{wanted}: {container_env:?}"
        );
    }
    assert!(
        !container_env.iter().any(|e| e.starts_with("E2E_UNSET")),
        "{container_env:?}"
    );
    assert_eq!(
        docker_ok(&["inspect", "-f", "{{.HostConfig.Privileged}}", cid]).trim(),
        "false"
    );
    let args_file = runner_dir(&home, &running).join("stub-runner.args");
    wait_until("the runner writes its arguments", STATUS_BOUND, || {
        args_file.exists()
    });
    let args = fs_err::read_to_string(&args_file).unwrap();
    let args: Vec<&str> = args.lines().collect();
    for pair in [
        ["--log-level", "5"],
        ["--http-port", "11999"],
        ["--ssh-port", "11022"],
        ["--ssh-log-level", "debug"],
    ] {
        assert!(args.windows(2).any(|w| w == pair), "{pair:?} in {args:?}");
    }

    // The dstack server's own decisions about this shim.
    let out = Command::new(&python)
        .arg(repo_root().join("tests/dstack-server/check_shim.py"))
        .arg(format!("http://{addr}"))
        .arg("--host-info")
        .arg(&host_info)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("check_shim.py:\n{stdout}");
    assert!(
        out.status.success(),
        "the dstack server's checks fail ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.ends_with(" passed, 0 failed"), "{last}");

    let api = shim.api();
    api.terminate("env-1", "terminated_by_server", "", 0)
        .unwrap();
    wait_container_stopped(cid);
    api.remove_retrying("env-1", STATUS_BOUND).unwrap();
    drop(shim);
}
