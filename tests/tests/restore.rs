//! Restore and ownership, one scenario in every world (see `world/mod.rs`): what a shim
//! recognises as its own across restarts, and what it never touches.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod world;

use world::{Options, World};

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
    for (round, (id, code)) in [("owner-lost", 0), ("owner-replaced", 3)]
        .into_iter()
        .enumerate()
    {
        w.submit(&w.task(id, 2)).await.unwrap();
        let before = w.wait_status(id, "running").await;
        let cid = before["container_id"].as_str().unwrap().to_owned();
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
        assert_eq!(after["status"], "running", "{after}");
        for field in ["container_id", "gpus_ids", "ports"] {
            assert_eq!(after[field], before[field], "{field}: {after}");
        }
        assert_eq!(w.container_running(&cid).await, Some(true));
        assert_eq!(w.container_started(&cid).await, started, "restarted");
        // Its two GPUs are held: a task asking for three cannot have them.
        let greedy = format!("{id}-greedy");
        w.submit(&w.task(&greedy, 3)).await.unwrap();
        let refused = w.wait_status(&greedy, "terminated").await;
        assert_eq!(refused["termination_reason"], "executor_error", "{refused}");
        w.remove(&greedy).await;

        // The other home's shim, running and restarted, neither lists nor touches it.
        if let Some(listed) = other.relist().await {
            assert!(listed);
        }
        other.restart().await;
        assert!(other.list().await.is_empty());
        assert_eq!(w.container_running(&cid).await, Some(true));

        w.exit_runner(&after, code).await;
        let done = w.wait_status(id, "terminated").await;
        let reason = if code == 0 {
            "done_by_runner"
        } else {
            "container_exited_with_error"
        };
        assert_eq!(done["termination_reason"], reason, "{done}");
        w.remove(id).await;
        assert_eq!(w.container_running(&cid).await, None);
    }
    assert!(other.list().await.is_empty());
}
in_worlds!(a_lost_or_replaced_owner_id_orphans_no_task: fake, docker, binary);

// SPEC §5: two shims on two homes share one engine and never touch each other's tasks: the
// other one lists nothing, relists without stopping anything, and adopts nothing when it
// restarts.
async fn two_homes_never_touch_each_other<W: World>() {
    let w = W::new(Options::default()).await;
    let mut other = w.neighbour().await;
    assert_ne!(w.owner(), other.owner());
    w.submit(&w.task("mine", 1)).await.unwrap();
    let info = w.wait_status("mine", "running").await;
    let cid = info["container_id"].as_str().unwrap();
    if let Some(listed) = other.relist().await {
        assert!(listed);
    }
    assert!(other.list().await.is_empty());
    other.restart().await;
    assert!(
        other.list().await.is_empty(),
        "the other shim adopted nothing"
    );
    assert_eq!(w.container_running(cid).await, Some(true));
    w.terminate("mine", "terminated_by_server", "", 0).await;
    w.remove("mine").await;
}
in_worlds!(two_homes_never_touch_each_other: fake, docker, binary);
