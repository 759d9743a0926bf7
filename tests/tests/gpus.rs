//! GPU tasks for real (issue 36), against the built `dstack-shim` on real Docker, on a fake
//! GPU host the shim cannot tell from a real one ([`FakeGpuHost`]: fake device nodes, the
//! vendor's tool printing its real formats, a CDI spec naming the nodes;
//! `tests/gpu-host/README.md`): the shim detects the GPUs, chooses how they reach containers
//! (CDI on an engine that applies it), and a container sees exactly its GPUs' device nodes and
//! environment. Also: GPUs placed by the host's interconnect, unhealthy GPUs kept from new
//! tasks (a scenario of every world, `world/mod.rs`), upstream's device request refused by an
//! engine without NVIDIA's runtime, AMD's and Tenstorrent's device mappings.
//!
//! One fake GPU host at a time on a machine (its CDI spec is global to the engine): the tests
//! queue on its lock. Gating: ignored unless run with `--run-ignored all`; needs Docker
//! (`SHIM_TEST_DOCKER=1`) and root (`SHIM_TEST_ROOT=1`: `mknod`, a mount namespace).
//!
//! Run: `SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1 cargo nextest run -p shim-e2e --test gpus
//! --run-ignored all`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test code: a failed unwrap is a failed test; figures and logs go to stderr"
)]

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;
use shim_e2e::harness::{
    CdiName, FakeGpuHost, FakeVendor, TestShim, bridge_task, docker_ok, run_tag, wait_for,
};
use shim_e2e::require_docker_and_root;
use world::{GPUS, Options, World, cid, gpu_ids, message};

mod world;

/// Bound of the waits (never a timed assertion).
const WAIT: Duration = Duration::from_secs(60);

/// A shim started inside `host`, with `args`.
fn shim_on(host: &FakeGpuHost, args: &[&str]) -> TestShim {
    TestShim::builder("gpus").gpu_host(host).args(args).start()
}

/// A task `id` asking for `gpu` GPUs.
fn task(id: &str, gpu: i64) -> Value {
    bridge_task(id, &format!("gpu-{id}-{}", run_tag()), gpu)
}

/// Submits a task `id` asking for `gpu` GPUs and waits until it is `status`; its TaskInfo.
fn submit_until(shim: &TestShim, id: &str, gpu: i64, status: &str) -> Value {
    assert_eq!(shim.submit(&task(id, gpu)).status, 200);
    shim.wait_status(id, status)
}

/// The `dstack_shim_gpu_device_mode` gauge of `mode`.
fn device_mode(shim: &TestShim, mode: &str) -> Option<f64> {
    shim.metrics()
        .try_get("dstack_shim_gpu_device_mode", &[("mode", mode)])
}

/// Checks that a terminated task ended for `reason`, its message saying `words`.
fn assert_ended(info: &Value, reason: &str, words: &str) {
    assert_eq!(info["termination_reason"], reason, "{info}");
    assert!(message(info).contains(words), "{info}");
}

/// Submits a task `id` asking for `gpu` GPUs, which must end for `reason` saying `words`, and
/// removes it.
fn submit_refused(shim: &TestShim, id: &str, gpu: i64, reason: &str, words: &str) {
    assert_ended(&submit_until(shim, id, gpu, "terminated"), reason, words);
    shim.remove_retrying(id);
}

/// The indexes of `host`'s GPUs the API gave the task of `info` (NVIDIA's ids are the UUIDs,
/// an AMD GPU's its render node).
fn indexes(host: &FakeGpuHost, info: &Value) -> BTreeSet<usize> {
    let ids = gpu_ids(info);
    host.ids()
        .iter()
        .enumerate()
        .filter(|(_, id)| ids.contains(*id))
        .map(|(i, _)| i)
        .collect()
}

/// What `command` prints in the container of a task (`docker exec`).
fn exec(info: &Value, command: &[&str]) -> String {
    docker_ok(&[&["exec", cid(info)], command].concat())
}

/// The entries of `dir` in the container of a task.
fn ls(info: &Value, dir: &str) -> BTreeSet<String> {
    let listed = exec(info, &["ls", dir]);
    listed.split_whitespace().map(str::to_owned).collect()
}

/// Checks that the container of `info` sees exactly the device nodes and the per-device
/// environment of its GPUs (`/dev/nvidia<i>`, `DSTACK_FAKE_GPU_<i>`), and no other GPU's.
fn assert_sees_exactly_its_gpus(host: &FakeGpuHost, info: &Value) {
    let mine = indexes(host, info);
    assert!(!mine.is_empty(), "{info}");
    // The main process's environment is what the engine gave the container: CDI's edits
    // reach it, not `docker exec`'s.
    let (dev, environ) = (ls(info, "/dev"), exec(info, &["cat", "/proc/1/environ"]));
    let env: BTreeSet<&str> = environ.split('\0').collect();
    for (i, uuid) in host.uuids().iter().enumerate() {
        let (node, var) = (format!("nvidia{i}"), format!("DSTACK_FAKE_GPU_{i}={uuid}"));
        let is_mine = mine.contains(&i);
        let seen = (dev.contains(&node), env.contains(var.as_str()));
        assert_eq!(seen, (is_mine, is_mine), "{node} {var}: {dev:?} {env:?}");
    }
    assert!(dev.contains("nvidiactl"), "the spec's common node: {dev:?}");
}

/// Issue 36, SPEC §6–§7: on an NVIDIA host with a CDI spec and an engine that applies CDI
/// (the main engine, Docker 28.5), GPUs go as CDI devices; a task sees exactly its GPUs'
/// device nodes and environment and no other's; two tasks get disjoint GPUs; a task asking
/// more than are free gets upstream's error; after a restart of the shim (SIGKILL) the running
/// tasks keep their GPUs and nobody else gets them; removing a task frees them for the next.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn gpu_tasks_get_exactly_their_gpus_through_cdi() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 4, |_| ());
    let mut shim = shim_on(&host, &[]);
    assert_eq!(device_mode(&shim, "cdi"), Some(1.0), "{}", shim.log_tail());
    let info = shim.get("/api/instance/info").json_body();
    assert_eq!(info["gpu_vendor"], "nvidia", "{info}");

    for id in ["a", "b"] {
        assert_eq!(shim.submit(&task(id, 2)).status, 200);
    }
    let a = shim.wait_status("a", "running");
    let b = shim.wait_status("b", "running");
    assert!(gpu_ids(&a).is_disjoint(&gpu_ids(&b)), "{a}\n{b}");
    assert_sees_exactly_its_gpus(&host, &a);
    assert_sees_exactly_its_gpus(&host, &b);
    let no_capacity = "no capacity: 1 GPUs requested, 0 available";
    submit_refused(&shim, "none-left", 1, "executor_error", no_capacity);

    // A crash: the running tasks keep their GPUs, and nobody else gets them.
    shim.restart();
    for (id, before) in [("a", &a), ("b", &b)] {
        let now = shim.wait_status(id, "running");
        assert_eq!(gpu_ids(&now), gpu_ids(before), "{now}");
    }
    submit_refused(&shim, "still-none", 1, "executor_error", no_capacity);

    // Removing a frees its GPUs for the next task.
    shim.finish("a");
    let c = submit_until(&shim, "c", 2, "running");
    assert_eq!(gpu_ids(&c), gpu_ids(&a));
    assert_sees_exactly_its_gpus(&host, &c);
    shim.finish("b");
    shim.finish("c");
}

/// Issue 36: a spec naming GPUs the old way (`gpu0`, `nvidia-ctk` before 1.14) or by UUID
/// only: the shim names each GPU as the spec does, and the container gets it.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn every_naming_of_cdi_devices_is_understood() {
    require_docker_and_root();
    for names in [vec![CdiName::Legacy], vec![CdiName::Uuid]] {
        let host = FakeGpuHost::with(FakeVendor::Nvidia, 2, |o| o.cdi_names = Some(names.clone()));
        let shim = shim_on(&host, &[]);
        let one = submit_until(&shim, "one", 1, "running");
        assert_sees_exactly_its_gpus(&host, &one);
        shim.finish("one");
        drop(shim);
        host.teardown().unwrap();
        eprintln!("MEASURED CDI names {names:?}: a task got its GPU");
    }
}

/// Issue 36: GPUs placed by the interconnect. On a fake host printing the recorded matrix of
/// a 4-GPU box with NVLink bridges in pairs (GPU0–GPU1, GPU2–GPU3; vllm-project/vllm#29070),
/// once the shim has read it: with GPU0 taken, a task asking for two gets the bridged pair
/// GPU2+GPU3, not first-free's GPU1+GPU2.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn gpus_are_placed_by_their_interconnect() {
    require_docker_and_root();
    let topology = Some("a30-nvlink-pairs-4gpu".to_owned());
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 4, |o| o.topology = topology);
    let shim = shim_on(&host, &[]);
    wait_for("the shim read the interconnect", WAIT, || {
        let log = shim.all_logs();
        log.contains("GPU interconnect read")
            .then_some(())
            .ok_or_else(|| shim.log_tail())
    });
    let first = submit_until(&shim, "first", 1, "running");
    assert_eq!(indexes(&host, &first), BTreeSet::from([0]));
    let pair = submit_until(&shim, "pair", 2, "running");
    assert_eq!(indexes(&host, &pair), BTreeSet::from([2, 3]));
    assert_sees_exactly_its_gpus(&host, &pair);
    shim.finish("first");
    shim.finish("pair");
}

// Issue 36: a GPU that goes unhealthy (retired pages pending) is kept from new tasks: a task
// asking for more than the healthy free GPUs gets upstream's no-capacity error naming it and
// why; `/metrics` says which GPU and why (and, from the binary, the instance health answer);
// the task already holding a GPU that went bad keeps it and runs on; once healthy again, the
// GPU is handed out. In the binary world the GPUs are a fake GPU host's and `nvidia-smi -q`
// reports the bad pages.
async fn an_unhealthy_gpu_is_kept_from_new_tasks_until_it_recovers<W: World>() {
    const RETIRED: &str = "retired pages pending";
    let w = W::new(Options::with(|o| o.gpu_health = true)).await;
    let ids = w.gpu_ids();
    let holder = w.submitted("holder", 1, "running").await;
    let held = ids.iter().position(|id| gpu_ids(&holder).contains(id));
    let held = held.unwrap_or_else(|| panic!("{holder}"));
    let bad = if held == 1 { 2 } else { 1 };
    let unhealthy = async |i: usize| {
        let labels = [("gpu", ids[i].as_str()), ("reason", RETIRED)];
        w.metrics()
            .await
            .try_get("dstack_shim_gpu_unhealthy", &labels)
    };
    w.set_gpu_healthy(held, false).await;
    w.set_gpu_healthy(bad, false).await;
    w.wait_until("both GPUs are unhealthy", async || {
        unhealthy(held).await.is_some() && unhealthy(bad).await.is_some()
    })
    .await;
    assert_eq!(unhealthy(bad).await, Some(1.0), "{:?}", w.metrics().await);
    assert_eq!(unhealthy(held).await, Some(1.0));
    if let Some(shim) = w.binary() {
        let health = shim.get("/api/instance/health").json_body();
        let gpus = health["gpus"].as_array().unwrap();
        let listed = gpus.iter().find(|g| g["id"] == ids[bad].as_str());
        let listed = listed.unwrap_or_else(|| panic!("{health}"));
        assert_has!(listed, {"healthy": false, "reasons": [RETIRED]}, "{health}");
        assert!(health.get("dcgm").is_some(), "upstream's field: {health}");
    }

    let rest = GPUS - 1;
    let refused = w.submitted("all-left", rest as i64, "terminated").await;
    let expected = format!(
        "no capacity: {rest} GPUs requested, {} available (1 kept out as unhealthy: {} \
         ({RETIRED}))",
        rest - 1,
        ids[bad]
    );
    assert_ended(&refused, "executor_error", &expected);
    w.remove("all-left").await;
    let holder = w.info("holder").await.unwrap();
    assert_eq!(holder["status"], "running", "running tasks are not touched");

    w.set_gpu_healthy(bad, true).await;
    w.wait_until("the GPU is healthy again", async || {
        unhealthy(bad).await.is_none()
    })
    .await;
    let all = w.submitted("all-rest", rest as i64, "running").await;
    assert!(gpu_ids(&all).contains(&ids[bad]), "{all}");
    for id in ["holder", "all-rest"] {
        w.finish(id).await;
    }
}
in_worlds!(an_unhealthy_gpu_is_kept_from_new_tasks_until_it_recovers: fake, docker, binary);

/// Issue 36: upstream's NVIDIA device request (`--gpu-device-mode legacy`) needs NVIDIA's
/// runtime hook, which this host lacks: Docker refuses the start ("could not select device
/// driver"), and the task ends `creating_container_error` with the engine's words, its GPUs
/// released (before: `container_exited_with_error`).
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_device_request_the_engine_refuses_is_a_creating_container_error() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 2, |_| ());
    let shim = shim_on(&host, &["--gpu-device-mode", "legacy"]);
    assert_eq!(device_mode(&shim, "legacy"), Some(1.0));
    let refused = "could not select device driver";
    submit_refused(&shim, "legacy", 1, "creating_container_error", refused);
    let after = submit_until(&shim, "after", 2, "terminated");
    let released = !message(&after).contains("no capacity");
    assert!(released, "the first task's GPU was released: {after}");
    shim.remove_retrying("after");
}

/// Issue 36, SPEC §6: AMD. Without a CDI spec, upstream's device mappings (`/dev/kfd` and the
/// GPU's render node, nothing of another GPU's; the fake nodes also on the host's `/dev`,
/// where the engine looks a mapping up: this test runs alone, `.config/nextest.toml`); with
/// AMD's spec (`amd.com/gpu`), CDI: the container gets its GPU's nodes from the spec.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn amd_gpus_go_as_device_mappings_or_through_cdi() {
    require_docker_and_root();
    for (names, mode) in [(Some(vec![]), "legacy"), (None, "cdi")] {
        let host = FakeGpuHost::with(FakeVendor::Amd, 2, |o| {
            o.host_nodes = mode == "legacy";
            o.cdi_names = names;
        });
        let shim = shim_on(&host, &[]);
        assert_eq!(device_mode(&shim, mode), Some(1.0), "{}", shim.log_tail());
        let info = submit_until(&shim, "amd", 1, "running");
        let mine = indexes(&host, &info);
        assert_eq!(mine.len(), 1, "{info}");
        let (dev, nodes) = (ls(&info, "/dev"), ls(&info, "/dev/dri"));
        assert!(dev.contains("kfd"), "{mode}: {dev:?}");
        for i in 0..2 {
            let node = format!("renderD{}", 128 + i);
            let (seen, is_mine) = (nodes.contains(&node), mine.contains(&i));
            assert_eq!(
                seen, is_mine,
                "{mode}: {node} in {nodes:?} (mine: {mine:?})"
            );
        }
        // Upstream's settings of an AMD container, whichever way the devices go (a CDI
        // spec cannot carry them). upstream: runner/internal/shim/docker.go (configureGpus).
        let cid = info["container_id"].as_str().unwrap();
        let host_config =
            "{{.HostConfig.IpcMode}} {{.HostConfig.CapAdd}} {{.HostConfig.SecurityOpt}}";
        let settings = docker_ok(&["inspect", "-f", host_config, cid]);
        let settings: Vec<&str> = settings.split(['[', ']', ' ', '\n']).collect();
        for wanted in ["host", "SYS_PTRACE", "seccomp=unconfined"] {
            assert!(settings.contains(&wanted), "{mode}: {settings:?}");
        }
        eprintln!("MEASURED AMD {mode}: /dev/dri {nodes:?}");
        shim.finish("amd");
        drop(shim);
        host.teardown().unwrap();
    }
}

/// Issue 36, SPEC §6: Tenstorrent keeps upstream's device mappings (`/dev/tenstorrent/<id>`),
/// whatever the mode: the container sees its device and not another's (the fake nodes also on
/// the host's `/dev`: this test runs alone, `.config/nextest.toml`).
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn tenstorrent_devices_are_mapped() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Tenstorrent, 2, |o| o.host_nodes = true);
    let shim = shim_on(&host, &[]);
    let info = submit_until(&shim, "tt", 1, "running");
    let ids = gpu_ids(&info);
    assert_eq!(ids.len(), 1, "{info}");
    assert_eq!(ls(&info, "/dev/tenstorrent"), ids, "{info}");
    shim.finish("tt");
}

/// SPEC §6: `/dev/infiniband` present → mapped, memlock unlimited; looked at each create, as
/// upstream does (runner/internal/shim/docker.go, `configureHpcNetworkingIfAvailable`): one
/// that appears after the shim started (the RDMA modules loaded late, OFED installed) counts
/// from the next task on. The device node is a fake (`mknod`) on the host's own `/dev`: this
/// test runs alone (`.config/nextest.toml`). What the containers are created with is read
/// back from the engine: a daemon that may not raise the memlock limit (this VM's) fails the
/// second start, with runc's words.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn infiniband_is_looked_at_each_create() {
    /// Removes the fake `/dev/infiniband` however the test ends.
    struct Node;
    impl Drop for Node {
        fn drop(&mut self) {
            let _ = fs_err::remove_dir_all("/dev/infiniband");
        }
    }
    require_docker_and_root();
    let dir = std::path::Path::new("/dev/infiniband");
    assert!(
        !dir.exists(),
        "this host has InfiniBand: the test would change it"
    );
    let shim = TestShim::builder("infiniband").start();
    let tag = run_tag();
    // The task's container's devices and limits, once its start has ended either way.
    let created = |id: &str| {
        let task = bridge_task(id, &format!("ib-{id}-{tag}"), 0);
        assert_eq!(shim.submit(&task).status, 200);
        let info = wait_for("the start's end", WAIT, || {
            let info = shim.info(id);
            match info["status"].as_str() {
                Some("running" | "terminated") => Ok(info),
                _ => Err(info.to_string()),
            }
        });
        let cid = info["container_id"].as_str().unwrap().to_owned();
        let format = "{{json .HostConfig.Devices}} {{json .HostConfig.Ulimits}}";
        (info, docker_ok(&["inspect", "-f", format, &cid]))
    };
    let (before, before_config) = created("before");
    fs_err::create_dir(dir).unwrap();
    let _node = Node;
    let made = std::process::Command::new("mknod")
        .args(["/dev/infiniband/uverbs0", "c", "231", "192"])
        .status();
    assert!(made.unwrap().success());
    let (after, after_config) = created("after");
    assert_eq!(before["status"], "running", "{before}");
    assert!(!before_config.contains("infiniband"), "{before_config}");
    assert!(after_config.contains("/dev/infiniband"), "{after_config}");
    assert!(
        after_config.contains(r#""Name":"memlock","Hard":-1,"Soft":-1"#),
        "{after_config}"
    );
    if after["status"] == "running" {
        assert_eq!(
            ls(&after, "/dev/infiniband"),
            BTreeSet::from(["uverbs0".to_owned()])
        );
    } else {
        assert!(message(&after).contains("rlimit"), "{after}");
    }
    for id in ["before", "after"] {
        if shim.info(id)["status"] == "running" {
            shim.finish(id);
        } else {
            shim.remove_retrying(id);
        }
    }
}
