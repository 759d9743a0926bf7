//! Restore and ownership: what a shim recognises as its own across restarts, and what it never
//! touches, one scenario in every world (see `world/mod.rs`); then what only the binary shows:
//! a shutdown or SIGTERM leaves containers running, upstream's containers, state files and
//! key lines followed by upstream's rules, the first release's home migrated.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use shim_e2e::harness::{
    NamedContainer, TestShim, assert_running, container_name_of, container_running, entries,
    owner_identity, server_task, ssh_key, task_entries, wait_until,
};
use shim_e2e::{docker_ok, image, require_docker};

use world::{GPUS, Options, World, cid, gpu_ids, message, read_json};

/// What a restore keeps of a running task: its status, container, GPUs and ports.
fn kept(info: &Value) -> Value {
    world::pick(info, ["status", "container_id", "gpus_ids", "ports"])
}

// Issue 22, SPEC §5: ownership is the runner mount. With its `owner-id` deleted (first round)
// or replaced by another identity (second round) while the shim is down, a running task is
// still `running` in the same container, which was neither stopped nor restarted (it keeps
// the old owner label), its GPUs stay held, and its runner's later exit is processed (0 →
// `done_by_runner`, 3 → `container_exited_with_error`). A second shim on another home on the
// same engine, running throughout and restarted, never lists or touches it.
async fn a_lost_or_replaced_owner_id_orphans_no_task<W: World>() {
    let mut w = W::new(Options::default()).await;
    let mut other = w.neighbour().await;
    let owner_file = w.home().join("owner-id");
    let rounds = [
        ("owner-lost", 0, "done_by_runner"),
        ("owner-replaced", 3, "container_exited_with_error"),
    ];
    for (round, (id, code, reason)) in rounds.into_iter().enumerate() {
        let before = w.submitted(id, 2, "running").await;
        let cid = cid(&before).to_owned();
        let started = w.container_started(&cid).await;
        let old_owner = w.owner();

        w.stop().await;
        if round == 0 {
            fs_err::remove_file(&owner_file).unwrap();
        } else {
            fs_err::write(&owner_file, "0123456789abcdef\n").unwrap();
        }
        w.start().await;
        assert_ne!(w.owner(), old_owner);
        let after = w.info(id).await.unwrap();
        assert_eq!(kept(&after), kept(&before), "{after}");
        assert_eq!(w.container_running(&cid).await, Some(true));
        assert_eq!(w.container_started(&cid).await, started, "restarted");
        // Its two GPUs are held: a task asking for three cannot have them.
        let greedy = format!("{id}-greedy");
        let refused = w.submitted(&greedy, 3, "terminated").await;
        assert_has!(refused, {"termination_reason": "executor_error"});
        w.remove(&greedy).await;

        // The other home's shim, running and restarted, neither lists nor touches it.
        assert_ne!(other.relist().await, Some(false), "a relist fails");
        other.restart().await;
        assert!(other.list().await.is_empty());
        assert_eq!(w.container_running(&cid).await, Some(true));

        w.exit_runner(&after, code).await;
        let done = w.wait_status(id, "terminated").await;
        assert_has!(done, {"termination_reason": reason});
        w.remove(id).await;
        assert_eq!(w.container_running(&cid).await, None);
    }
    assert!(other.list().await.is_empty());
}
in_worlds!(a_lost_or_replaced_owner_id_orphans_no_task: fake, docker, binary);

// SPEC §4–§5: a start on a full disk with no owner identity stored (deleted while the shim
// was down; an upstream home switched to this shim looks the same) restores its tasks all the
// same: the identity serves that run only, and the next start with room stores one. The
// identity is a label; what makes a container this shim's is its runner mount. A start that
// failed for it left every task unwatched until the disk had room again.
async fn a_full_disk_without_an_owner_id_still_starts_and_restores<W: World>() {
    let mut w = W::new(Options::with(|o| o.fillable_home = true)).await;
    let before = w.submitted("full-start", 1, "running").await;
    let owner_file = w.home().join("owner-id");
    w.stop().await;
    fs_err::remove_file(&owner_file).unwrap();
    w.set_disk_full(true).await;
    w.start().await;
    assert_eq!(kept(&w.info("full-start").await.unwrap()), kept(&before));
    assert!(!owner_file.exists(), "stored on a full disk");
    w.set_disk_full(false).await;
    w.restart().await;
    assert!(owner_file.exists(), "not stored once there was room");
    assert_eq!(kept(&w.info("full-start").await.unwrap()), kept(&before));
    w.finish("full-start").await;
    assert_eq!(w.containers().await, 0);
}
// Not in the binary world: its full disk (a file filling a small file system) still takes a
// file of a few bytes, so the owner identity is stored there and the scenario shows nothing.
in_worlds!(a_full_disk_without_an_owner_id_still_starts_and_restores: fake, docker);

// SPEC §5: two shims on two homes share one engine and never touch each other's tasks: the
// other one lists nothing, relists without stopping anything, and adopts nothing when it
// restarts.
async fn two_homes_never_touch_each_other<W: World>() {
    let w = W::new(Options::default()).await;
    let mut other = w.neighbour().await;
    assert_ne!(w.owner(), other.owner());
    let info = w.submitted("mine", 1, "running").await;
    let cid = cid(&info);
    assert_ne!(other.relist().await, Some(false), "a relist fails");
    assert!(other.list().await.is_empty());
    other.restart().await;
    assert!(
        other.list().await.is_empty(),
        "the other shim adopted nothing"
    );
    assert_eq!(w.container_running(cid).await, Some(true));
    w.finish("mine").await;
}
in_worlds!(two_homes_never_touch_each_other: fake, docker, binary);

// SPEC §5: the owner identity is stored in the home, so it does not depend on how the home is
// spelled. Restarted with the home spelled `<home>/`, `<dir>/./home`, through a symbolic link
// and as `<home>/../home`, the task still runs in the same container (never restarted) with
// the same GPUs and ports, and the owner is the same; its GPUs stay held (a task asking for
// the others gets exactly those).
async fn the_owner_identity_does_not_depend_on_how_the_home_is_spelled<W: World>() {
    let mut w = W::new(Options::default()).await;
    let before = w.submitted("same", 2, "running").await;
    let cid = cid(&before).to_owned();
    let (owner, started) = (w.owner(), w.container_started(&cid).await);
    let home = std::path::absolute(w.home()).unwrap();
    let (dir, name) = (
        home.parent().unwrap(),
        home.file_name().unwrap().to_str().unwrap(),
    );
    let link = dir.join(format!("{name}-link"));
    std::os::unix::fs::symlink(&home, &link).unwrap();
    let spellings = [
        format!("{}/", home.display()),
        format!("{}/./{name}", dir.display()),
        link.display().to_string(),
        format!("{}/../{name}", home.display()),
    ];
    for spelled in spellings {
        w.restart_spelling_home_as(Path::new(&spelled)).await;
        let info = w.info("same").await.unwrap();
        assert_eq!(kept(&info), kept(&before), "home {spelled}: {info}");
        assert_eq!(w.owner(), owner, "home {spelled}");
        let container = (
            w.container_running(&cid).await,
            w.container_started(&cid).await,
            w.containers().await,
        );
        let expected = (Some(true), started.clone(), 1);
        assert_eq!(
            container, expected,
            "home {spelled}: (runs, started, containers)"
        );
    }
    let rest: BTreeSet<String> = w.gpu_ids().into_iter().collect();
    let rest: BTreeSet<String> = rest.difference(&gpu_ids(&before)).cloned().collect();
    let probe = w.submitted("probe", 2, "running").await;
    assert_eq!(gpu_ids(&probe), rest, "{probe}");
    for id in ["probe", "same"] {
        w.finish(id).await;
    }
    assert_eq!(w.containers().await, 0);
}
in_worlds!(the_owner_identity_does_not_depend_on_how_the_home_is_spelled: fake, docker, binary);

// SPEC §1, §4, §5: the shim stops with tasks running and starts again on the same home.
// - a task that kept running is the same task (same container, ports, GPUs), still running;
// - a task whose runner exited with 3 while the shim was down is `terminated` /
//   `container_exited_with_error` with its last log lines in the very first answer after the
//   start (the restore ran before the API answered);
// - the kept task's GPUs are locked again (never handed out twice), the ended task's are free.
async fn a_restart_keeps_running_tasks_and_judges_exits_made_while_down<W: World>() {
    let mut w = W::new(Options::default()).await;
    let [keep, exits] = w.all_running([("keep", 2), ("exits", 2)]).await;
    let keep_cid = cid(&keep);
    let exits_cid = cid(&exits);

    w.stop().await;
    assert_eq!(w.container_running(keep_cid).await, Some(true));
    w.exit_runner(&exits, 3).await;
    w.wait_stopped(exits_cid).await;
    w.start().await;

    let first = w.info("exits").await.unwrap();
    assert_has!(first, {"status": "terminated", "termination_reason": "container_exited_with_error",
                        "container_id": exits_cid});
    let message = first["termination_message"].as_str().unwrap();
    let lines: Vec<&str> = message.lines().collect();
    assert!((1..=5).contains(&lines.len()), "{message:?}");
    assert_eq!(lines.last(), Some(&"runner exiting with 3"), "{message:?}");
    let now = w.info("keep").await.unwrap();
    assert_eq!(kept(&now), kept(&keep), "{now}");
    let list = w.list().await;
    assert_eq!(list.len(), 2, "{list:?}");
    assert_eq!(list["keep"], "running");
    assert_eq!(list["exits"], "terminated");

    // The ended task's two GPUs are free, the kept task's two are not.
    let more = w.submitted("more", 2, "running").await;
    assert_eq!(gpu_ids(&more), gpu_ids(&exits), "{more}");
    let refused = w.submitted("none-left", 1, "terminated").await;
    assert_has!(refused, {"termination_reason": "executor_error", "container_id": ""});

    // `none-left` stays: its start job may still be writing its last state when its
    // termination shows, and a remove then races that write (see lifecycle.rs,
    // `a_task_removed_during_its_start_stays_removed`).
    for id in ["keep", "more"] {
        w.terminate(id, "terminated_by_server", "", 0).await;
    }
    for id in ["keep", "exits", "more"] {
        w.remove(id).await;
    }
    assert_eq!(w.containers().await, 0);
}
in_worlds!(a_restart_keeps_running_tasks_and_judges_exits_made_while_down: fake, docker, binary);

// An image made of a GPU task's container (`docker commit` keeps its labels, this shim's GPU
// label among them) lends a task started from it no GPU: the task holds none, before a
// restart and after, and the donor's GPU stays the donor's alone, so all the others can be
// had and no more. The create sets the GPU label even when empty, and a create's labels win
// over the image's; without it the restore believed the image's label, locked the donor's GPU
// for the task without GPUs and, with both restored, could free it under the donor.
async fn an_images_labels_lend_a_task_no_gpu<W: World>() {
    let mut w = W::new(Options::default()).await;
    let donor = w.submitted("donor", 1, "running").await;
    let image = w.commit(cid(&donor), &[]).await;
    let mut task = w.task("plain", 0);
    task["image_name"] = image.reference.clone().into();
    w.submit(&task).await.unwrap();
    let plain = w.wait_status("plain", "running").await;
    assert_eq!(plain["gpus_ids"], json!([]), "{plain}");
    w.restart().await;
    assert_eq!(kept(&w.info("plain").await.unwrap()), kept(&plain));
    assert_eq!(gpu_ids(&w.info("donor").await.unwrap()), gpu_ids(&donor));
    let rest = w.submitted("rest", GPUS as i64 - 1, "running").await;
    assert!(gpu_ids(&rest).is_disjoint(&gpu_ids(&donor)), "{rest}");
    let refused = w.submitted("none-left", 1, "terminated").await;
    assert_has!(refused, {"termination_reason": "executor_error"});
    for id in ["donor", "plain", "rest"] {
        w.finish(id).await;
    }
    assert_eq!(w.containers().await, 0);
}
in_worlds!(an_images_labels_lend_a_task_no_gpu: fake, docker, binary);

// Issue 22, SPEC §5: a termination reason the upstream shim recorded wins at adoption. Its
// state file (no fields of this shim) says `terminated_by_user`; its container exited with
// code 3 before this shim started. The task reads `terminated_by_user` (not
// `container_exited_with_error` from the exit code), at start-up, after full relists (the
// exit code in sight) and after a restart, and the state file keeps the reason.
// upstream: runner/internal/shim/docker.go (restoreStateFromContainers: an exited container
// restores as terminated), runner/internal/shim/task.go (a terminated task keeps its first
// reason).
async fn an_upstream_recorded_reason_wins_over_its_containers_exit<W: World>() {
    let mut w = W::new(Options::with(|o| o.relist_every_s = Some(1))).await;
    w.stop().await;
    let task = w.task("upstream-r", 0);
    let (dir, cid) = w
        .plant_upstream_task(&task, Some("terminated_by_user"), Some(3))
        .await;
    w.start().await;
    let check = |info: Option<Value>, when: &str| {
        let ended = "terminated_by_user";
        assert_has!(info.unwrap(), {"status": "terminated", "termination_reason": ended,
                                    "container_id": cid}, "{when}:");
    };
    check(w.info("upstream-r").await, "at start-up");
    for _ in 0..2 {
        assert_ne!(w.relist().await, Some(false), "a relist fails");
    }
    check(w.info("upstream-r").await, "after full relists");
    w.restart().await;
    check(w.info("upstream-r").await, "after a restart");
    let file = read_json(&dir.join("task.json"));
    assert_has!(file, {"termination_reason": "terminated_by_user"});
    w.remove("upstream-r").await;
    assert!(!dir.exists());
    assert_eq!(w.container_running(&cid).await, None);
}
in_worlds!(an_upstream_recorded_reason_wins_over_its_containers_exit: fake, docker, binary);

// Issue 11, the switch from the upstream shim with tasks running: upstream's containers
// (labels, mounts, command) and directories, with and without its state file (dstack PR
// #4220's format version 1) and one whose runner finished before the switch. Each task is
// listed with its status, survives a restart of this shim, is terminated and removed, and
// releases exactly what it holds: its container and its directory; nothing of this shim is
// written into a directory the container sees whole; another home's upstream container is
// never listed or touched. (GPUs, keys and volumes an upstream task holds: the fake world's
// and the binary's own tests.)
// upstream: runner/internal/shim/docker.go (restoreStateFromContainers: the is-task label,
// the task id label, the runner directory from the `/tmp/runner` mount, `exited` →
// terminated; Remove deletes the runner directory).
async fn upstream_tasks_are_adopted_terminated_removed_and_released<W: World>() {
    let mut w = W::new(Options::default()).await;
    w.stop().await;
    let with_file = w.task("upstream-a", 0);
    let (dir_a, cid_a) = w.plant_upstream_task(&with_file, Some(""), None).await;
    // Without a state file (upstream before PR #4220): the whole directory is mounted.
    let (dir_b, cid_b) = w
        .plant_upstream_task(&w.task("upstream-b", 0), None, None)
        .await;
    // Its runner finished before the switch: upstream shows it terminated with no reason;
    // this shim reads the exit code.
    let (dir_c, cid_c) = w
        .plant_upstream_task(&w.task("upstream-c", 0), Some(""), Some(0))
        .await;
    let elsewhere = tempfile::tempdir().unwrap();
    let foreign = w
        .run_upstream_container(&w.task("upstream-f", 0), elsewhere.path(), None)
        .await;
    w.start().await;

    let expected = BTreeMap::from([
        ("upstream-a".to_owned(), "running".to_owned()),
        ("upstream-b".to_owned(), "running".to_owned()),
        ("upstream-c".to_owned(), "terminated".to_owned()),
    ]);
    assert_eq!(w.list().await, expected);
    let a_name = container_name_of(&with_file);
    let a = w.info("upstream-a").await.unwrap();
    assert_has!(a, {"container_id": cid_a, "container_name": a_name});
    assert_has!(w.info("upstream-b").await.unwrap(), {"container_id": cid_b});
    assert_has!(w.info("upstream-c").await.unwrap(),
                {"termination_reason": "done_by_runner", "container_id": cid_c});
    let written_by_others = ["stub-runner.args", "stub-runner.pid"];
    let left = entries(&dir_b);
    assert!(
        left.iter().all(|e| written_by_others.contains(&e.as_str())),
        "{left:?}"
    );
    assert_eq!(w.container_running(&cid_a).await, Some(true));
    assert_eq!(w.container_running(&cid_b).await, Some(true));

    // This shim's own restart keeps them as they are.
    w.restart().await;
    assert_eq!(w.list().await, expected);
    assert_has!(w.info("upstream-a").await.unwrap(), {"container_id": cid_a});
    assert_has!(w.info("upstream-c").await.unwrap(), {"termination_reason": "done_by_runner"});

    // Terminate and remove: each releases exactly its own.
    let t = w
        .terminate("upstream-a", "terminated_by_server", "switched", 2)
        .await;
    assert_eq!(t["status"], "terminated", "{t}");
    assert_eq!(w.container_running(&cid_a).await, Some(false));
    let file = || read_json(&dir_a.join("task.json"));
    w.wait_until("a's release is recorded", async || {
        file()["cleaned_up"] == true
    })
    .await;
    assert_has!(file(), {"version": 1, "termination_reason": "terminated_by_server",
                         "termination_message": "switched", "cleaned_up": true});
    assert_eq!(w.container_running(&cid_b).await, Some(true));
    w.remove("upstream-a").await;
    assert!(!dir_a.exists());
    assert_eq!(w.container_running(&cid_a).await, None);

    w.terminate("upstream-b", "terminated_by_server", "switched", 2)
        .await;
    assert!(!dir_b.join("task.json").exists(), "never written");
    w.remove("upstream-b").await;
    assert!(
        !dir_b.exists(),
        "upstream's Remove deletes the runner directory"
    );
    assert_eq!(w.container_running(&cid_b).await, None);
    w.remove("upstream-c").await;
    assert!(!dir_c.exists());
    assert_eq!(w.container_running(&cid_c).await, None);
    assert!(w.list().await.is_empty());
    assert_eq!(
        w.container_running(&foreign).await,
        Some(true),
        "another home's container is never touched"
    );
}
in_worlds!(upstream_tasks_are_adopted_terminated_removed_and_released: fake, docker, binary);

// SPEC §5 and §8 (nothing the container can write is trusted): an adopted upstream container
// mounts its whole task directory, so a state file in it is the container's. One that says
// the task ended (which, trusted, would stop the container at the next start) is ignored at
// every start: the task runs on in its container; once the container is removed while no
// shim runs, the next start forgets the task and deletes its directory.
async fn a_state_file_an_upstream_container_could_write_is_never_read<W: World>() {
    let mut w = W::new(Options::default()).await;
    w.stop().await;
    let task = w.task("upstream-w", 0);
    let (dir, cid) = w.plant_upstream_task(&task, None, None).await;
    w.start().await;
    assert_has!(w.info("upstream-w").await.unwrap(), {"status": "running", "container_id": cid});
    let forged = world::upstream_state_file(&task, "done_by_runner");
    fs_err::write(dir.join("task.json"), forged).unwrap();
    w.restart().await;
    assert_has!(w.info("upstream-w").await.unwrap(), {"status": "running"});
    assert_eq!(w.container_running(&cid).await, Some(true));
    w.stop().await;
    w.remove_container(&cid).await;
    w.start().await;
    assert!(
        w.info("upstream-w").await.is_none(),
        "forgotten with its container"
    );
    assert!(!dir.exists(), "its directory is deleted");
    assert!(w.list().await.is_empty());
}
in_worlds!(a_state_file_an_upstream_container_could_write_is_never_read: fake, docker, binary);

// SPEC §5, every restore case after the shim stopped with tasks in every state, and the
// engine changed meanwhile: a task still running is the same task in the same container; one
// whose runner exited meanwhile is `container_exited_with_error` with its last lines; a
// recorded reason is kept; a container created but never started ends the task
// `executor_error` ("never started"); a task cut short while pulling (a state file, no
// container) ends `executor_error` and its directory is removable. Only the running task's
// GPU is locked again. A second restart changes nothing. (What a real authorized_keys and a
// real volume show of it: a_restart_releases_the_real_keys_and_volumes_of_tasks_that_ended.)
async fn a_restart_restores_every_case<W: World>() {
    let mut w = W::new(Options::default()).await;
    let tasks = [("run", 1), ("exits", 1), ("user", 0), ("never", 0)];
    let [run, exits, _, never] = w.all_running(tasks).await;
    w.terminate("user", "terminated_by_user", "user said so", 0)
        .await;
    let image = w.slow_image("world-restore-pull").await;
    let mut cut = w.task("cut", 0);
    image.for_task(&mut cut);
    w.submit(&cut).await.unwrap();
    let pulling = async || w.info("cut").await.unwrap()["status"] == "pulling";
    w.wait_until("cut pulls", pulling).await;
    w.stop().await;

    w.exit_runner(&exits, 4).await;
    w.wait_stopped(cid(&exits)).await;
    w.replace_with_created(&never).await;
    w.start().await;

    let r = w.info("run").await.unwrap();
    assert_has!(r, {"status": "running", "container_id": run["container_id"]});
    let e = w.info("exits").await.unwrap();
    assert_has!(e, {"termination_reason": "container_exited_with_error"});
    let exit_message = message(&e).to_owned();
    assert!(exit_message.ends_with("runner exiting with 4"), "{e}");
    let u = w.info("user").await.unwrap();
    assert_has!(u, {"termination_reason": "terminated_by_user",
                    "termination_message": "user said so"});
    let n = w.info("never").await.unwrap();
    assert_has!(n, {"termination_reason": "executor_error"});
    assert!(message(&n).contains("never started"), "{n}");
    let c = w.info("cut").await.unwrap();
    assert_has!(c, {"status": "terminated", "termination_reason": "executor_error"});
    assert!(message(&c).contains("pulling"), "{c}");
    // Only the running task's GPU is held: all the others are free, and no more.
    w.submit(&w.task("rest", (GPUS - 1) as i64)).await.unwrap();
    w.wait_status("rest", "running").await;
    w.finish("rest").await;
    let all = w.submitted("all", GPUS as i64, "terminated").await;
    assert_has!(all, {"termination_reason": "executor_error"});

    // Restoring again changes nothing.
    w.restart().await;
    assert_eq!(message(&w.info("exits").await.unwrap()), exit_message);
    assert_eq!(w.info("run").await.unwrap()["status"], "running");
    let dir = w
        .home()
        .join("runners")
        .join(c["container_name"].as_str().unwrap());
    assert!(dir.join("task.json").exists());
    w.remove("cut").await;
    assert!(!dir.exists());
    w.terminate("run", "terminated_by_server", "", 0).await;
    for id in ["run", "exits", "user", "never"] {
        w.remove(id).await;
    }
}
in_worlds!(a_restart_restores_every_case: fake, docker, binary);

// SPEC §5: what a kill between creating a task directory and its first state write leaves (a
// directory with nothing but an empty `runner/`, or nothing at all) and what a kill during a
// delete leaves (a `.trash-…` directory: the real one of a removed task, and one with files in
// it) are gone after a restart; a directory with anything else in it is left alone, a running
// task is untouched and keeps its GPU, and the removed task's GPU is free.
async fn a_restart_clears_what_kills_mid_submit_and_mid_delete_left<W: World>() {
    let mut w = W::new(Options::default()).await;
    let (stays, removed) = (w.task("stays", 1), w.task("removed", 1));
    w.submit(&stays).await.unwrap();
    w.submit(&removed).await.unwrap();
    let before = w.wait_status("stays", "running").await;
    let removed_info = w.wait_status("removed", "running").await;
    w.terminate("removed", "terminated_by_user", "gone", 0)
        .await;
    w.stop().await;

    let runners = w.home().join("runners");
    // A remove killed after its container was removed and its directory renamed to trash.
    w.remove_container(cid(&removed_info)).await;
    let removed_name = container_name_of(&removed);
    let trash = runners.join(format!(".trash-{removed_name}-1700000000000"));
    fs_err::rename(runners.join(&removed_name), &trash).unwrap();
    // A delete killed half-way through removing a tree.
    let old_trash = runners.join(".trash-flt-old-89abcdef-1700000000001");
    fs_err::create_dir_all(old_trash.join("runner/sub")).unwrap();
    fs_err::write(old_trash.join("runner/sub/deep.txt"), "x").unwrap();
    fs_err::write(old_trash.join("pull.log"), "{}").unwrap();
    // Submits killed before their first state write.
    fs_err::create_dir_all(runners.join("flt-skel-0123abcd/runner")).unwrap();
    fs_err::create_dir_all(runners.join("flt-bare-0123abcd")).unwrap();
    // Not ours to judge: anything else in a directory without a state file.
    let keep = [
        ("notes", "notes.txt"),
        ("flt-busy-0123abcd", "runner/output.log"),
        ("flt-extra-0123abcd", "pull.log"),
    ];
    for (d, f) in keep {
        let file = runners.join(d).join(f);
        fs_err::create_dir_all(file.parent().unwrap()).unwrap();
        fs_err::write(&file, format!("keep {d}")).unwrap();
    }
    fs_err::create_dir_all(runners.join("flt-extra-0123abcd/runner")).unwrap();

    w.start().await;
    assert!(
        w.info("removed").await.is_none(),
        "a removed task came back"
    );
    let after = w.info("stays").await.unwrap();
    assert_eq!(kept(&after), kept(&before), "{after}");
    let kept: BTreeSet<String> = keep.iter().map(|(d, _)| (*d).to_owned()).collect();
    let mut expected = kept.clone();
    expected.insert(container_name_of(&stays));
    assert_eq!(task_entries(&runners), expected);
    for (d, f) in keep {
        let content = fs_err::read_to_string(runners.join(d).join(f)).unwrap();
        assert_eq!(content, format!("keep {d}"));
    }
    // The removed task's GPU is free, the running task's is not.
    w.submit(&w.task("probe", (GPUS - 1) as i64)).await.unwrap();
    let probe = w.wait_status("probe", "running").await;
    assert!(gpu_ids(&probe).is_disjoint(&gpu_ids(&after)), "{probe}");
    for id in ["probe", "stays"] {
        w.finish(id).await;
    }
    assert_eq!(w.containers().await, 0);
    assert_eq!(task_entries(&runners), kept);
}
in_worlds!(a_restart_clears_what_kills_mid_submit_and_mid_delete_left: fake, docker, binary);

// SPEC §5 with real resources held (every restore case in every world: above): the engine on
// Docker with the real authorized_keys code and a real loop-device volume. After the shim
// stopped, a task whose runner exited meanwhile has its key removed from the user's real
// authorized_keys and its volume unmounted; a task cut short while pulling has its key
// removed. Needs root (losetup, mount).
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_restart_releases_the_real_keys_and_volumes_of_tasks_that_ended() {
    shim_e2e::require_root();
    world::with_docker(async {
        const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe user@host";
        const OTHER: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKzk3CWHbq3U5nQ6BHV1ToyN2NUxT9b3FbiIYDwGBtJd other@host";
        let mut w = world::DockerWorld::new(Options::default()).await;
        let name = format!("vol{}", shim_e2e::harness::run_tag());
        let vol = w.loop_volume(&name);
        let mut exits = w.task("exits", 1);
        exits["host_ssh_user"] = "tester".into();
        exits["host_ssh_keys"] = json!([KEY]);
        exits["volumes"] = json!([{
            "backend": "gcp", "name": name, "volume_id": "", "init_fs": true, "device_name": name,
        }]);
        exits["volume_mounts"] = json!([{"name": name, "path": "/data"}]);
        w.submit(&exits).await.unwrap();
        let exits = w.wait_status("exits", "running").await;
        let image = w.slow_image("world-restore-keys").await;
        let mut cut = w.task("cut", 0);
        image.for_task(&mut cut);
        cut["host_ssh_user"] = "tester".into();
        cut["host_ssh_keys"] = json!([OTHER]);
        w.submit(&cut).await.unwrap();
        let pulling = async || w.info("cut").await.unwrap()["status"] == "pulling";
        w.wait_until("cut pulls", pulling).await;
        assert!(w.authorized_keys().contains("user@host"));
        assert!(w.authorized_keys().contains("other@host"));
        assert!(vol.is_mounted());
        w.stop().await;

        w.exit_runner(&exits, 4).await;
        w.wait_stopped(cid(&exits)).await;
        w.start().await;
        let e = w.info("exits").await.unwrap();
        assert_has!(e, {"termination_reason": "container_exited_with_error"});
        let keys = w.authorized_keys();
        assert!(!keys.contains("user@host"), "{keys}");
        assert!(!vol.is_mounted());
        assert_has!(w.info("cut").await.unwrap(), {"termination_reason": "executor_error"});
        assert!(!w.authorized_keys().contains("other@host"));
        w.remove("exits").await;
        w.remove("cut").await;
    });
}

// ---------------------------------------------------------------------------------------------
// The binary only (real Docker, HTTP; ignored unless run with `--run-ignored all`)
// ---------------------------------------------------------------------------------------------

/// Bound of the waits (never a timed assertion).
const STATUS_BOUND: Duration = Duration::from_secs(90);

/// Fails the test unless the container runs.
fn assert_container_running(id: &str) {
    assert_eq!(container_running(None, id), Some(true), "container {id}");
}

/// SPEC §3 shutdown and §1: `POST /api/shutdown` (graceful and forced) and SIGTERM stop the
/// shim and leave the containers running; each restarted shim finds the task running in the
/// same container.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn shutdown_and_sigterm_leave_containers_running() {
    require_docker();
    let mut shim = TestShim::builder("e2e").start();
    let config = server_task("stays", 1);
    shim.submit(&config).ok();
    let before = shim.wait_status("stays", "running");
    let cid = cid(&before).to_owned();

    // A malformed shutdown request shuts nothing down.
    shim.post_raw("/api/shutdown", Some("application/json"), b"{\"force\":")
        .assert_error(400, "Request body contains badly-formed JSON");
    shim.post("/api/shutdown", &json!({"force": "yes"}))
        .assert_error(
            400,
            "Request body contains an invalid value for the \"force\" field (at position 14)",
        );
    assert_eq!(shim.info("stays")["status"], "running");

    let check_restart = |shim: &mut TestShim, how: &str| {
        assert_container_running(&cid);
        shim.start();
        let info = shim.info("stays");
        assert_running(&info, &config, 1);
        assert_has!(info, {"container_id": cid, "gpus_ids": before["gpus_ids"]}, "after {how}:");
    };

    for force in [false, true] {
        shim.post("/api/shutdown", &json!({ "force": force }))
            .assert_empty_ok();
        let status = shim.wait_exit();
        assert!(status.success(), "shutdown force={force}: {status}");
        check_restart(&mut shim, &format!("shutdown force={force}"));
    }

    shim.sigterm();
    let status = shim.wait_exit();
    assert!(status.success(), "SIGTERM: {status}");
    check_restart(&mut shim, "SIGTERM");

    shim.finish("stays");
    assert_eq!(shim.container_ids(), BTreeSet::new());
}

// ---------------------------------------------------------------------------------------------
// Upstream's on-host contract (a host switched to and from the upstream Go shim)
// ---------------------------------------------------------------------------------------------

// Issue 11, the switch from the upstream shim: the key line upstream added for a task
// (verbatim, no marker) stays in the user's authorized_keys while the adopted task runs and
// across a restart of this shim, and goes with the task; the user's own line stays. (The
// adoption itself, in every world: above. Real key lines across a restart: not the fake world,
// whose keys are new fakes at each start.)
// upstream: runner/internal/shim/authorized_keys.go (keys appended verbatim, removed by
// fingerprint).
async fn an_upstream_tasks_key_line_stays_while_it_runs_and_goes_with_it<W: World>() {
    let mut w = W::new(Options::with(|o| o.host_user = true)).await;
    let keys = w.host_user().unwrap();
    let own_key = ssh_key("the-user's-own-key");
    let task_key = ssh_key("upstream-task-key");
    w.add_own_key_line(&own_key);
    w.add_own_key_line(&task_key);
    let both = [own_key.clone(), task_key.clone()];
    let mut config = w.task("upstream-k", 0);
    config["host_ssh_user"] = json!(keys.user);
    config["host_ssh_keys"] = json!([task_key]);
    w.stop().await;
    let (_dir, cid) = w.plant_upstream_task(&config, Some(""), None).await;

    w.start().await;
    assert_eq!(w.info("upstream-k").await.unwrap()["status"], "running");
    assert_eq!(keys.lines(), both);
    w.restart().await;
    assert_eq!(keys.lines(), both);

    w.terminate("upstream-k", "terminated_by_server", "switched", 2)
        .await;
    let own = vec![own_key];
    w.wait_until("the upstream key line goes", async || keys.lines() == own)
        .await;
    w.remove("upstream-k").await;
    assert_eq!(keys.lines(), own);
    assert_eq!(w.container_running(&cid).await, None);
}
in_worlds!(an_upstream_tasks_key_line_stays_while_it_runs_and_goes_with_it: docker, binary);

/// Issue 11, the switch the other way: what this shim leaves on the host is what the upstream
/// shim adopts. Its container carries upstream's labels, mounts the task's `runner/`
/// directory at `/tmp/runner`, and `task.json` decodes into upstream's state with Go's
/// rules (format version 1, each field of `TaskConfig` present with its JSON type, integers
/// where Go has integers, registry credentials blank); a reason appears only once terminated.
///
/// upstream: runner/internal/shim/docker.go (restoreStateFromContainers, DockerMounts),
/// runner/internal/shim/models.go (TaskConfig).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn this_shims_containers_and_state_files_follow_upstreams_rules() {
    require_docker();
    let shim = TestShim::builder("e2e").start();
    let mut config = server_task("ours-1", 1);
    config["registry_username"] = json!("someone");
    config["registry_password"] = json!("never-on-disk");
    config["container_ssh_keys"] = json!([ssh_key("e2e@ours")]);
    config["cpu"] = json!(1.5);
    config["memory"] = json!(1_073_741_824_i64);
    shim.submit(&config).ok();
    let info = shim.wait_status("ours-1", "running");
    let cid = cid(&info);
    let dir = shim
        .home()
        .join("runners")
        .join(info["container_name"].as_str().unwrap());

    let inspect = |format: &str| -> Value {
        serde_json::from_str(&docker_ok(&["inspect", "-f", format, cid])).unwrap()
    };
    let labels = inspect("{{json .Config.Labels}}");
    assert_has!(labels, {"ai.dstack.shim.is-task": "true", "ai.dstack.shim.task-id": "ours-1"});
    let mounts = inspect("{{json .Mounts}}");
    let mut runner = mounts.as_array().unwrap().iter();
    let runner = runner
        .find(|m| m["Destination"] == "/tmp/runner")
        .unwrap_or_else(|| panic!("{mounts}"));
    assert_eq!(
        Path::new(runner["Source"].as_str().unwrap()),
        dir.join("runner")
    );

    let bytes = fs_err::read(dir.join("task.json")).unwrap();
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(
        !text.contains("never-on-disk") && !text.contains("someone"),
        "{text}"
    );
    let file: Value = serde_json::from_slice(&bytes).unwrap();
    assert_has!(file, {"version": 1, "id": "ours-1", "termination_reason": "",
                       "termination_message": "", "cleaned_up": false});
    let stored = &file["config"];
    // Go's TaskConfig: each field, its JSON type (an int field refuses 1.0).
    let strings = "id name registry_username registry_password image_name container_user \
                   network_mode host_ssh_user";
    for f in strings.split_whitespace() {
        assert!(stored[f].is_string(), "{f}: {stored}");
    }
    for f in ["gpu", "memory", "shm_size"] {
        assert!(stored[f].is_i64(), "{f} must be a JSON integer: {stored}");
    }
    assert!(stored["cpu"].is_number(), "{stored}");
    assert!(stored["privileged"].is_boolean(), "{stored}");
    let lists = "volumes volume_mounts instance_mounts gpu_devices host_ssh_keys \
                 container_ssh_keys";
    for f in lists.split_whitespace() {
        assert!(stored[f].is_array() || stored[f].is_null(), "{f}: {stored}");
    }
    assert_eq!(stored.as_object().unwrap().len(), 19, "{stored}");
    let sent = "id name image_name container_user gpu cpu memory network_mode container_ssh_keys";
    for f in sent.split_whitespace() {
        assert_eq!(stored[f], config[f], "{f}");
    }
    assert_has!(stored, {"registry_username": "", "registry_password": ""});

    shim.terminate("ours-1", "terminated_by_user", "bye", 0)
        .ok();
    wait_until("the release is recorded", STATUS_BOUND, || {
        let file = read_json(&dir.join("task.json"));
        file["termination_reason"] == "terminated_by_user"
            && file["termination_message"] == "bye"
            && file["cleaned_up"] == true
    });
    shim.remove_retrying("ours-1");
}

/// A state file byte for byte as the first release of this shim wrote it (captured from that
/// release's binary, commit 57e98cf, for a bridge-mode task with one GPU).
fn first_release_state_file(id: &str, name: &str, cname: &str, cid: &str, gpu: &str) -> String {
    format!(
        r#"{{
  "schema_version": 1,
  "task": {{
    "id": "{id}",
    "name": "{name}",
    "container_name": "{cname}",
    "config": {{
      "id": "{id}",
      "name": "{name}",
      "image_name": "{image}",
      "registry_username": "",
      "container_user": "root",
      "privileged": false,
      "gpu": 1,
      "cpu": 0.0,
      "memory": 0,
      "shm_size": 0,
      "network_mode": "bridge",
      "volumes": [],
      "volume_mounts": [],
      "instance_mounts": [],
      "gpu_devices": [],
      "host_ssh_user": "",
      "host_ssh_keys": [],
      "container_ssh_keys": []
    }},
    "status": "running",
    "termination_reason": null,
    "termination_message": "",
    "container_id": "{cid}",
    "resources": {{
      "gpus": [
        "{gpu}"
      ],
      "host_keys": null,
      "volumes": [],
      "created_dirs": [],
      "released": false
    }},
    "created_at_ms": 1796058356297,
    "updated_at_ms": 1796058357104
  }}
}}
"#,
        image = image(),
    )
}

/// Issue 11, the first upgrade: a home written by this shim's first release (`tasks/<id>/`,
/// the `{"schema_version": 1, "task": ..}` envelope, containers labelled
/// `ai.dstack.shim.task=true` with an owner derived from the home's path) is migrated at start
/// with its task running: the task keeps its container and GPU, the home's owner identity is
/// the one its containers carry, the state file moves to `runners/<container name>/task.json`
/// in upstream's format, and the runner, whose bind-mounted directory moved with it, still
/// ends the task through it. A second start finds everything migrated already.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn first_release_home_is_migrated_with_its_task_running() {
    require_docker();
    let mut shim = TestShim::builder("e2e").build();
    // The first release derived its owner from the home's path: what the harness computes
    // for a home without an owner-id file.
    let legacy_owner = owner_identity(shim.home());
    let id = "first-1";
    let config = server_task(id, 1);
    let name = config["name"].as_str().unwrap().to_owned();
    let cname = container_name_of(&config);
    let old_dir = shim.home().join("tasks").join(id);
    fs_err::create_dir_all(old_dir.join("runner")).unwrap();
    let gpu = "GPU-00000000-0000-4000-8000-000000000002";

    let _guard = NamedContainer(cname.clone());
    let labels = [
        "ai.dstack.shim.task=true".to_owned(),
        format!("ai.dstack.shim.task-id={id}"),
        format!("ai.dstack.shim.owner={legacy_owner}"),
        format!("ai.dstack.shim.gpus={gpu}"),
    ];
    let cid = world::run_foreign_container(&cname, &labels, &old_dir.join("runner"), true);
    fs_err::write(
        old_dir.join("task.json"),
        first_release_state_file(id, &name, &cname, &cid, gpu),
    )
    .unwrap();

    shim.start();
    assert_has!(shim.info(id), {"status": "running", "container_id": cid, "gpus_ids": [gpu]});
    assert_eq!(shim.owner(), legacy_owner);
    assert!(
        !shim.home().join("tasks").exists(),
        "the old layout is gone"
    );
    let new_dir = shim.home().join("runners").join(&cname);
    let file = read_json(&new_dir.join("task.json"));
    assert_has!(file, {"version": 1, "id": id});
    assert_eq!(file["config"]["gpu"], config["gpu"], "{file}");
    assert_container_running(&cid);

    // Its GPU stays locked: four fake GPUs, one held, so four more cannot be had.
    let greedy = server_task("first-greedy", 4);
    shim.submit(&greedy).ok();
    let refused = shim.wait_status("first-greedy", "terminated");
    assert_has!(refused, {"termination_reason": "executor_error"});

    // Idempotent: a second start finds the new layout and the same task.
    shim.kill();
    shim.start();
    let again = shim.info(id);
    assert_has!(again, {"status": "running", "container_id": cid});
    assert_eq!(shim.owner(), legacy_owner);

    // The runner still sees its directory at the new path: it ends the task through it.
    shim.exit_runner(&again, 0);
    let done = shim.wait_status(id, "terminated");
    assert_has!(done, {"termination_reason": "done_by_runner"});
    shim.remove_retrying(id);
    assert!(!new_dir.exists());
    assert_eq!(container_running(None, &cid), None);
    shim.remove_retrying("first-greedy");
}
