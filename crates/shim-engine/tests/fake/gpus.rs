//! How a task's GPUs reach its container: CDI devices or a device request, Podman without a spec, a start refused for its devices, upstream's display-capability retry.

use super::*;

/// On an NVIDIA host a start that fails on `/dev/nvidia-modeset` is retried once: the
/// container is removed (a failure there ends the start), created again without the `display`
/// capability, and started.
///
/// upstream: runner/internal/shim/docker.go (executeTask:
/// shouldRetryWithoutNvidiaDisplayCapability, "remove container before retry").
#[tokio::test(start_paused = true)]
async fn nvidia_display_retry() {
    let (w, engine) = World::with_engine(1).await;
    w.runtime.queue_start_behavior(StartBehavior::Fail(
        "error gathering device information while adding custom device \"/dev/nvidia-modeset\": no such file or directory".into(),
    ));
    let info = run(&engine, config("t1").with_gpus(1)).await;
    assert_eq!(w.runtime.count("create"), 2);
    let spec = w.runtime.spec(&info.container_id).unwrap();
    let caps = &spec.device_requests[0].capabilities;
    assert!(!caps.iter().any(|c| c == "display"), "{caps:?}");
    assert_eq!(state_file(&w, "t1")["container_id"], info.container_id);
}

// On Podman a task given NVIDIA GPUs must not run without them (its Docker API ignores the
// device request): without a CDI spec the create is refused before the engine is asked, and
// the task ends `creating_container_error` saying why and which command makes a spec, as any
// failed create, its GPU released (issue 36).
#[tokio::test(start_paused = true)]
async fn a_gpu_task_on_podman_without_a_cdi_spec_fails_at_create() {
    let w = World::new(1);
    w.runtime.as_podman(Some("5.4.2"));
    let engine = w.engine().await;
    let info = failed_start(&engine, config("t1").with_gpus(1)).await;
    let why = "Podman 5.4.2 ignores NVIDIA device requests through its Docker API";
    assert_ended(&info, "creating_container_error", why);
    let fix = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml";
    assert_contains(&info.termination_message, fix);
    assert!(w.runtime.container_ids().is_empty());
    assert_scraped(&engine, "dstack_shim_gpu_device_mode{mode=\"refused\"} 1");
    wait_released(&engine, "t1").await;
    engine.remove(&tid("t1")).await.unwrap();
    // A task without GPUs runs there as usual.
    run(&engine, config("t2")).await;
}

/// A CDI spec of two fake GPUs, one named by UUID and one by index (as NVIDIA Container
/// Toolkit 1.18's `nvidia-ctk cdi generate` names them both ways), in a directory of its own.
fn cdi_spec_dir(host: &HostGpus) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n\
         - name: {uuid0}\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n\
         - name: \"1\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia1\n",
        uuid0 = host.gpus[0].id
    );
    fs_err::write(dir.path().join("nvidia.yaml"), spec).unwrap();
    dir
}

/// The device requests of the container created for `id`.
fn device_requests_of(w: &World, id: &str) -> Vec<DeviceRequest> {
    let name = container_name(id);
    let creates = w.calls_where(|c| matches!(c, Call::Create(spec) if spec.name == name));
    let Some(Call::Create(spec)) = creates.first() else {
        panic!("no create of {id}");
    };
    spec.device_requests.clone()
}

// Issue 36: where the engine applies CDI and a spec names the host's GPUs, a task's GPUs go as
// exactly their CDI names (the UUID where the spec has it, else the index), one device request
// of driver `cdi`; the same host without a spec gets upstream's `nvidia` request by UUID; a
// forced `legacy` never uses CDI.
#[tokio::test(start_paused = true)]
async fn gpus_go_as_cdi_devices_where_the_engine_and_a_spec_allow() {
    let w = World::new(2);
    let specs = cdi_spec_dir(&w.host_gpus);
    let cdi_dirs = Some(vec![specs.path().to_owned()]);
    let support = shim_runtime::GpuSupport::new("Docker 28.5.2", cdi_dirs, true);
    w.runtime.set_gpu_support(support);
    let engine = w.engine().await;
    // Decided at start-up.
    assert_scraped(&engine, "dstack_shim_gpu_device_mode{mode=\"cdi\"} 1");
    let info = run(&engine, config("both").with_gpus(2)).await;
    // GPU 0 by its UUID, GPU 1 by its index, as the spec names them.
    let uuid0 = &w.host_gpus.gpus[0].id;
    let cdi_name = |id: &String| match id == uuid0 {
        true => format!("nvidia.com/gpu={id}"),
        false => "nvidia.com/gpu=1".to_owned(),
    };
    let names = info.gpu_ids.iter().flatten().map(cdi_name).collect();
    assert_eq!(
        device_requests_of(&w, "both"),
        [DeviceRequest {
            driver: "cdi".into(),
            device_ids: names,
            capabilities: vec![],
        }]
    );
    terminate_by_user(&engine, "both").await;
    wait_released(&engine, "both").await;

    // The spec is gone (a host rebuilt): the next GPU task gets upstream's request.
    drop(specs);
    let info = run(&engine, config("legacy").with_gpus(1)).await;
    let requests = device_requests_of(&w, "legacy");
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].driver, "nvidia");
    assert_eq!(Some(requests[0].device_ids.clone()), info.gpu_ids);
    assert_scraped(&engine, "dstack_shim_gpu_device_mode{mode=\"legacy\"} 1");
}

// A daemon restarted as another version (Docker upgraded to one that applies CDI) is asked
// again what it can do with GPUs once its event stream was lost: the next GPU task gets CDI
// devices, not what the engine of the shim's start could do.
#[tokio::test(start_paused = true)]
async fn what_the_engine_does_with_gpus_is_asked_again_after_it_restarts() {
    let w = World::new(1);
    let specs = cdi_spec_dir(&w.host_gpus);
    let docker = |version: &str, cdi: bool| {
        let dirs = cdi.then(|| vec![specs.path().to_owned()]);
        shim_runtime::GpuSupport::new(version, dirs, true)
    };
    w.runtime.set_gpu_support(docker("Docker 27.5.1", false));
    let engine = w.engine().await;
    run(&engine, config("before").with_gpus(1)).await;
    assert_eq!(device_requests_of(&w, "before")[0].driver, "nvidia");
    terminate_by_user(&engine, "before").await;
    wait_released(&engine, "before").await;

    w.runtime.set_gpu_support(docker("Docker 28.5.2", true));
    w.runtime.break_event_streams();
    tokio::time::sleep(Duration::from_secs(10)).await;
    run(&engine, config("after").with_gpus(1)).await;
    assert_eq!(device_requests_of(&w, "after")[0].driver, "cdi");
}

// Issue 36: a start the engine refuses for the container's devices (here Docker's words for a
// CDI device no spec names) ends the task `creating_container_error` with the engine's
// words, not `container_exited_with_error`; its GPUs are released.
#[tokio::test(start_paused = true)]
async fn a_start_refused_for_devices_is_a_creating_container_error() {
    let w = World::new(1);
    let words = "CDI device injection failed: unresolvable CDI devices nvidia.com/gpu=0";
    w.runtime
        .set_start_behavior(StartBehavior::Fail(words.to_owned()));
    let engine = w.engine().await;
    let info = failed_start(&engine, config("t1").with_gpus(1)).await;
    assert_ended(&info, "creating_container_error", words);
    wait_released(&engine, "t1").await;
    // A start that fails for another reason stays the container's failure.
    let info = failed_start(&engine, config("t2")).await;
    assert_reason(&info, "container_exited_with_error");
}
