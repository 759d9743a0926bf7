//! Pulls and images: a pull shown as pulling, `latest` pulled at every start, an unused image collected when the data root fills.

use super::*;

/// Leaves 20 GiB available beside a 10 GiB image, 90 % used, and waits until the engine's
/// minute check has measured it (its statfs runs on a blocking thread).
async fn fill_data_root(w: &World, engine: &Engine) {
    w.disk.set_available(20 << 30);
    let full = "dstack_shim_image_fs_used_ratio 0.9";
    poll_until(100, Duration::from_secs(1), async || {
        scrape(engine).contains(full)
    })
    .await;
    assert_scraped(engine, full);
}

/// An engine with a data root, and task `t1` running the 10 GiB image `old:1` it pulled.
async fn running_old_image() -> (World, Engine) {
    let w = World::new(0).with_data_root();
    let engine = w.engine().await;
    run(&engine, config("t1").with_image("old:1")).await;
    w.runtime.set_image_size("old:1", 10 << 30);
    (w, engine)
}

/// Image collection on the fake runtime and a data root whose fullness the test sets (issue 28
/// part 3; the same on a real loop file system: `tests/tests/faults.rs`): at 50 % used nothing
/// is removed; a task's image this shim pulled stays while the task is known; once it is
/// removed and the disk is 90 % used, the next background check (every minute) removes that
/// image — and only it: the image the shim never pulled stays. What was freed is what the
/// file system got back (issue 39).
#[tokio::test(start_paused = true)]
async fn an_unused_pulled_image_is_collected_when_the_data_root_fills() {
    let (w, engine) = running_old_image().await;
    fill_data_root(&w, &engine).await;
    assert_eq!(w.deleted_images(), [], "the image of a known task stays");

    end_and_remove(&engine, "t1").await;
    let pulled_as = Call::DeleteImage("docker.io/library/old:1".into());
    let deleted = wait_deleted(&w).await;
    assert_eq!(deleted, [pulled_as], "by the name it was pulled as");
    assert!(w.runtime.image_id("old:1").is_none());
    assert!(w.runtime.image_id(IMAGE).is_some(), "not pulled: kept");
    let m = scrape(&engine);
    assert_contains(&m, "dstack_shim_image_gc_removed_images_total 1");
    let freed = format!("dstack_shim_image_gc_freed_bytes_total {}", 10u64 << 30);
    assert_contains(&m, &freed);
}

/// An image whose tag is `latest`, or starts so (`:latest-gpu`), is pulled at every start even
/// when present (it may have moved); any other tag is only checked.
///
/// upstream: runner/internal/shim/docker.go (pullImage: a name containing `:latest` is always
/// pulled, other images only when missing).
#[tokio::test(start_paused = true)]
async fn latest_is_pulled_at_every_start() {
    let (w, engine) = World::with_engine(0).await;
    for image in ["img:latest", "img:latest-gpu"] {
        w.runtime.add_image(image);
        for id in ["l1", "l2"] {
            w.runtime.clear_calls();
            let id = format!("{id}-{}", image.len());
            run(&engine, config(&id).with_image(image)).await;
            let counts = (w.runtime.count("pull"), w.runtime.count("image_present"));
            assert_eq!(counts, (1, 0), "pulls and checks of {id} ({image})");
        }
    }
    w.runtime.add_image("img:1-latest");
    w.runtime.clear_calls();
    run(&engine, config("other").with_image("img:1-latest")).await;
    let pulls = w.runtime.count("pull");
    assert_eq!(pulls, 0, "a tag that does not start with latest");
}

/// A real pull shows `pulling` while it lasts, also for a task that acquires nothing: the
/// engine writes the progress before it pulls.
#[tokio::test(start_paused = true)]
async fn a_real_pull_is_shown_as_pulling() {
    let (w, engine) = World::with_engine(0).await;
    submit_held_in_its_pull(&w, &engine, config("t1").with_image("img:latest")).await;
    assert_eq!(w.runtime.count("create"), 0);
    w.runtime.release_pulls();
    wait_status(&engine, "t1", TaskStatus::Running).await;
}

/// An image pulled by digest (`repo@sha256:…`) has no tag on Docker's classic store (the
/// digest is listed apart, in `RepoDigests`; the containerd store lists it among the tags
/// too, checked on Docker 28.5), so a task naming it by that digest must keep it all the same:
/// while a known task names it (here one whose start failed before any container, so no
/// container holds the image), a full data root collects nothing; once that task is removed,
/// the image goes, by id. It used to be judged by its tags alone, so it was unused and removed
/// under a task about to create from it, which then failed with the image vanished.
#[tokio::test(start_paused = true)]
async fn an_image_named_by_digest_stays_while_a_task_names_it() {
    let w = World::new(0).with_data_root();
    let engine = w.engine().await;
    let image = format!("repo/img@sha256:{}", "d".repeat(64));
    run(&engine, config("t1").with_image(&image)).await;
    let id = w.runtime.image_id(&image).expect("pulled");
    w.runtime.set_image_size(&image, 10 << 30);
    end_and_remove(&engine, "t1").await;
    // Known, naming the image, and without a container: it asks for a GPU the host lacks.
    failed_start(&engine, config("t2").with_image(&image).with_gpus(1)).await;
    fill_data_root(&w, &engine).await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(w.deleted_images(), [], "the image a known task names stays");

    engine.remove(&tid("t2")).await.unwrap();
    let by_id = [Call::DeleteImage(id)];
    assert_eq!(wait_deleted(&w).await, by_id, "by id: it has no tag");
    assert!(w.runtime.image_id(&image).is_none());
}

/// A task may name an image this shim pulled by tag by another name the engine resolves to it:
/// its digest (the engine's name, in `RepoDigests`, not the ledger's), a tag and that digest
/// (`repo:tag@sha256:…`, which the engine resolves by the digest alone), or its id, whole or
/// its start, with or without `sha256:`. While a known task names it so, a full data root
/// collects nothing; once that task is removed, the image goes by its tag. It used to be
/// judged by its tags and the ledger's names alone (and the tag-and-digest and id forms until
/// stop 57), and its removal took the name with it, under a task about to create from it.
#[tokio::test(start_paused = true)]
async fn an_image_a_task_names_by_its_digest_or_id_stays() {
    let hex = "0123456789abcdef".repeat(4);
    let digest = format!("sha256:{}", "e".repeat(64));
    let forms = [
        format!("org/app@{digest}"),
        format!("org/app:1@{digest}"),
        format!("sha256:{hex}"),
        hex.clone(),
        hex[..12].to_owned(),
    ];
    for form in forms {
        let w = World::new(0).with_data_root();
        let engine = w.engine().await;
        w.runtime.set_pull_id("org/app:1", &format!("sha256:{hex}"));
        run(&engine, config("t1").with_image("org/app:1")).await;
        let id = w.runtime.image_id("org/app:1").expect("pulled");
        w.runtime.set_image_size("org/app:1", 10 << 30);
        w.runtime
            .add_image_with_id(&format!("org/app@{digest}"), &id);
        end_and_remove(&engine, "t1").await;
        failed_start(&engine, config("t2").with_image(&form).with_gpus(1)).await;
        fill_data_root(&w, &engine).await;
        tokio::time::sleep(Duration::from_secs(120)).await;
        let kept = format!("the image a known task names as {form} stays");
        assert_eq!(w.deleted_images(), [], "{kept}");

        engine.remove(&tid("t2")).await.unwrap();
        let tag = Call::DeleteImage("docker.io/org/app:1".to_owned());
        assert_eq!(wait_deleted(&w).await, [tag], "{form}");
    }
}

/// An image this shim pulled that an operator then removed (`docker image prune`) leaves the
/// ledger when the engine reports the removal, not at the next pass that needs space (which a
/// roomy disk never makes): the ledger does not grow with images long gone.
#[tokio::test(start_paused = true)]
async fn an_image_removed_by_hand_leaves_the_ledger() {
    let (w, engine) = World::with_engine(0).await;
    run(&engine, config("t1").with_image("old:1")).await;
    let id = w.runtime.image_id("old:1").expect("pulled");
    let ledger = w.home.path().join("images.json");
    let recorded = || {
        fs_err::read_to_string(&ledger)
            .unwrap_or_default()
            .contains(&id)
    };
    assert!(recorded(), "the pull is recorded");
    end_and_remove(&engine, "t1").await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert!(recorded(), "no pass needed space");
    w.runtime.remove_image("old:1");
    let forgotten = poll_until(10, Duration::from_millis(100), async || !recorded()).await;
    assert!(forgotten, "{}", fs_err::read_to_string(&ledger).unwrap());
}

/// A task submitted while image collection removes its image (a removal takes seconds on a
/// large image) does not skip its pull for an image about to vanish, which ended it
/// `creating_container_error`: its pull step waits for the removal, finds the image gone and
/// pulls it again (SPEC §4: an image removed since it was last seen is pulled in the pull
/// step). A `:latest` image, pulled at every start, is not pulled during its removal either.
#[tokio::test(start_paused = true)]
async fn a_task_submitted_during_its_images_removal_pulls_it_again() {
    for image in ["old:1", "old:latest"] {
        let w = World::new(0).with_data_root();
        let engine = w.engine().await;
        run(&engine, config("t1").with_image(image)).await;
        w.runtime.set_image_size(image, 10 << 30);
        end_and_remove(&engine, "t1").await;
        w.runtime.hold_image_deletes();
        fill_data_root(&w, &engine).await;
        let deleting = async || !w.deleted_images().is_empty();
        assert!(
            poll_until(100, Duration::from_secs(1), deleting).await,
            "{image}"
        );
        let pulls = w.runtime.count("pull");
        let again = config("t2").with_image(image);
        engine.submit(again).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let waited = w.runtime.count("pull") == pulls;
        assert!(waited, "{image}: pulled during its removal");
        w.runtime.release_image_deletes();
        let t2 = wait_status(&engine, "t2", TaskStatus::Running).await;
        assert_eq!(t2.termination_reason, "", "{image}: {t2:?}");
        assert_eq!(w.runtime.count("pull"), pulls + 1, "{image}: pulled again");
    }
}

/// A task of another image does not wait for a removal (which on a large image takes
/// minutes), present or pulled: it runs while the removal is still out.
#[tokio::test(start_paused = true)]
async fn a_task_of_another_image_does_not_wait_for_a_removal() {
    let (w, engine) = running_old_image().await;
    end_and_remove(&engine, "t1").await;
    w.runtime.hold_image_deletes();
    fill_data_root(&w, &engine).await;
    let deleting = async || !w.deleted_images().is_empty();
    assert!(poll_until(100, Duration::from_secs(1), deleting).await);
    let other = run(&engine, config("t2")).await;
    assert_eq!(other.status, TaskStatus::Running);
    // One absent: its pull goes out (the pass under way frees the disk meanwhile).
    let pulls = w.runtime.count("pull");
    run(&engine, config("t3").with_image("new:1")).await;
    assert_eq!(w.runtime.count("pull"), pulls + 1);
    let still_out = w.runtime.image_id("old:1").is_some();
    assert!(still_out, "the removal was still out");
    w.runtime.release_image_deletes();
    let old_deleted = async || w.runtime.image_id("old:1").is_none();
    assert!(poll_until(100, Duration::from_secs(1), old_deleted).await);
}

/// A shim stopped between a pull's end in the engine and its record in the ledger (a kill, an
/// upgrade's exec) still collects the image it pulled: the name was recorded before the pull,
/// and a later pass resolves it, although the next task finds the image present and pulls
/// nothing. (The kill is played by a shutdown during the pull, the ledger put back as it was
/// at the kill, and the image made present as the engine finishing the pull would.)
#[tokio::test(start_paused = true)]
async fn an_image_pulled_just_before_a_kill_is_still_collected() {
    let mut w = World::new(0).with_data_root();
    w.runtime
        .set_pull_behavior(PullBehavior::Hang { steps: vec![] });
    let engine = w.engine().await;
    let t1 = config("t1").with_image("new:1");
    engine.submit(t1).await.unwrap();
    assert!(poll_until(100, TICK, async || w.runtime.count("pull") == 1).await);
    let ledger = w.home.path().join("images.json");
    let at_the_kill = fs_err::read_to_string(&ledger).unwrap();
    let recorded = at_the_kill.contains("docker.io/library/new:1");
    assert!(recorded, "{at_the_kill}");
    shut_down(engine).await;
    fs_err::write(&ledger, at_the_kill).unwrap();
    w.runtime.add_image("new:1");
    w.runtime.set_image_size("new:1", 10 << 30);
    let engine = w.fresh_process().await;
    engine.remove(&tid("t1")).await.unwrap();
    run(&engine, config("t2").with_image("new:1")).await;
    assert_eq!(w.runtime.count("pull"), 1, "present: not pulled again");
    end_and_remove(&engine, "t2").await;
    w.disk.set_available(20 << 30); // 90 % used: the next minute's pass collects
    let pulled_as = Call::DeleteImage("docker.io/library/new:1".into());
    assert_eq!(wait_deleted(&w).await, [pulled_as]);
}

/// A pull that fails leaves no name in the ledger: resolved later, it would name whatever image
/// the name points to then, such as one an operator pulled or loaded by hand, and collection
/// would remove an image the shim never pulled.
#[tokio::test(start_paused = true)]
async fn a_failed_pull_claims_no_image_pulled_later_by_hand() {
    let w = World::new(0).with_data_root();
    w.runtime.set_pull_behavior(PullBehavior::Fail {
        steps: vec![],
        message: "unauthorized".into(),
    });
    let engine = w.engine().await;
    failed_start(&engine, config("t1").with_image("org/app:1")).await;
    engine.remove(&tid("t1")).await.unwrap();
    let ledger = fs_err::read_to_string(w.home.path().join("images.json")).unwrap_or_default();
    assert!(!ledger.contains("org/app"), "{ledger}");
    w.runtime.add_image("org/app:1");
    w.runtime.set_image_size("org/app:1", 10 << 30);
    w.disk.set_available(20 << 30); // 90 % used
    tokio::time::sleep(Duration::from_secs(180)).await;
    assert_eq!(w.deleted_images(), [], "pulled by hand: never the shim's");
}

/// The engine's data root is asked again once its event stream was lost: a daemon restarted
/// with another (`data-root` moved to a bigger disk restarts Docker, not the shim) is measured
/// there; here one that named none names one after its restart, and an unused image the shim
/// pulled is collected when that disk fills.
#[tokio::test(start_paused = true)]
async fn the_data_root_is_asked_again_after_the_engine_restarts() {
    let (w, engine) = World::with_engine(0).await;
    run(&engine, config("t1").with_image("old:1")).await;
    w.runtime.set_image_size("old:1", 10 << 30);
    end_and_remove(&engine, "t1").await;
    w.disk.set_available(20 << 30);
    tokio::time::sleep(Duration::from_secs(150)).await;
    let kept = w.runtime.image_id("old:1").is_some();
    assert!(kept, "no data root: nothing measured");

    w.runtime.set_data_root(Some("/fake/docker".into()));
    w.runtime.break_event_streams();
    let deleted = wait_deleted(&w).await;
    assert!(w.runtime.image_id("old:1").is_none(), "{deleted:?}");
}
