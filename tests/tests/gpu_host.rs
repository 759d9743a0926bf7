//! The fake GPU host (`tests/gpu-host/fake_gpu_host.py`, [`FakeGpuHost`]): what it shows a
//! process run under its prefix, what the shim's own parsers read from its tools, what an
//! engine gives a container through its CDI spec, that the shim detects its GPUs as a real
//! host's, and that its teardown (or its owner's death) leaves nothing behind.
//!
//! The engine is the one at `DOCKER_HOST` (the main engine by default): `cargo xtask engine
//! start ENGINE` prints how to run tests against another. All pass on Docker 28.5 and 26.1 and
//! on Podman 5.4. On an engine without CDI (Docker 20.10; Podman 4.3, whose Docker API runs the
//! container without the devices) the two CDI container tests fail, and on Podman 4.3 the
//! Docker CLI refuses `--device` (`unknown server OS`), so the AMD and Tenstorrent tools fail
//! there as they would for the shim on such a host. The fake hosts take a machine-wide lock,
//! so these tests run one after the other whatever nextest's parallelism.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use shim_e2e::harness::{
    CdiName, FakeGpuHost, FakeGpuHostOptions, FakeHealth, FakeVendor, TestShim, docker_socket,
    run_with_cdi_devices, wait_for, wait_until,
};
use shim_e2e::{docker, image, require_docker_and_root};
use shim_resources::gpu::health::{GpuHealth, parse_nvidia_smi_bus_ids, parse_nvidia_smi_query};
use shim_resources::gpu::{AmdGpu, GpuInfo, GpuVendor, Link, UnhealthyReason};
use shim_resources::gpu::{parse_amd_smi, parse_nvidia_smi, parse_nvidia_topo, parse_tt_smi};

/// The shim's `nvidia-smi` list invocation (`shim_resources::gpu::detect`).
const NVIDIA_SMI_LIST: [&str; 3] = [
    "nvidia-smi",
    "--query-gpu=index,name,memory.total,uuid,driver_version",
    "--format=csv,noheader,nounits",
];
/// The bound of the waits below (a teardown by the holder, the shim's host info).
const BOUND: Duration = Duration::from_secs(60);

/// The words of a command line.
fn words(command: &str) -> Vec<&str> {
    command.split_whitespace().collect()
}

/// `host`'s NVIDIA GPUs as the health parsers read them, each with its `reasons`.
fn health<const N: usize>(
    host: &FakeGpuHost,
    reasons: [Vec<UnhealthyReason>; N],
) -> Vec<GpuHealth> {
    let gpus = host.uuids().into_iter().zip(host.bus_ids()).zip(reasons);
    let gpus = gpus
        .enumerate()
        .map(|(index, ((uuid, bus_id), reasons))| GpuHealth {
            uuid,
            index: index.try_into().unwrap(),
            bus_id,
            reasons,
        });
    gpus.collect()
}

/// Fails the test unless `output` has each of `present` as a whole line and none of `absent`
/// (`what`: the run, for the message).
fn assert_lines(what: &str, output: &str, present: &[&str], absent: &[&str]) {
    let lines: Vec<&str> = output.lines().collect();
    for line in present {
        assert!(lines.contains(line), "{what}: no {line}: {output}");
    }
    for line in absent {
        assert!(!lines.contains(line), "{what}: {line} too: {output}");
    }
}

/// `command` run in a container of the test image given the CDI `devices` (exit 0); its
/// output.
fn run_with(devices: &[&str], command: &[&str]) -> String {
    let run = run_with_cdi_devices(&docker_socket(), &image(), devices, command).unwrap();
    assert_eq!(run.exit_code, 0, "{devices:?}: {}", run.output);
    run.output
}

/// Whether `reference` is an image of the engine at `DOCKER_HOST`.
fn image_exists(reference: &str) -> bool {
    docker(&["image", "inspect", reference]).status.success()
}

/// Whether a fake host's lock holder `pid` has exited (the lock is then its no more; another
/// test's fake host may hold it already). A zombie has no command line.
fn gone(pid: u32) -> bool {
    fs_err::read(format!("/proc/{pid}/cmdline")).map_or(true, |cmdline| cmdline.is_empty())
}

/// The ids of the images `host` imported. Tests running beside this one import images of the
/// same names once this host is gone, so what is checked is that these ids are gone.
fn image_ids(host: &FakeGpuHost) -> Vec<String> {
    let record = host.record();
    let images = record["images"].as_array().unwrap();
    images
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn exec_shows_an_nvidia_host_that_the_host_itself_does_not_have() {
    require_docker_and_root();
    assert!(
        !Path::new("/dev/nvidiactl").exists(),
        "this machine has an NVIDIA driver: the fake host would hide nothing"
    );
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 3, |_| ());
    let uuids = host.uuids();
    assert_eq!(uuids.len(), 3);
    let well_formed = uuids.iter().all(|u| u.starts_with("GPU-") && u.len() == 40);
    assert!(well_formed, "{uuids:?}");

    // The nodes at their real paths, nvidia-smi first in PATH, for the command and its
    // children (a shell, here).
    let seen = host.exec_ok(&[
        "sh",
        "-c",
        "ls /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia0 /dev/nvidia1 /dev/nvidia2 && \
         command -v nvidia-smi",
    ]);
    let tool = format!("{}/bin/nvidia-smi", host.dir().display());
    assert!(seen.contains(&tool), "{seen}");
    let untouched = !Path::new("/dev/nvidiactl").exists();
    assert!(untouched, "the host's /dev changed");

    // The shim's invocations, read by the shim's own parsers.
    let csv = host.exec_ok(&NVIDIA_SMI_LIST);
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let gpus = (0..).zip(&uuids).map(|(index, id)| GpuInfo {
        vendor: GpuVendor::Nvidia,
        name: host.gpu_name(),
        memory_mib: 81920,
        id: id.clone(),
        index,
    });
    let driver = Some("535.129.03".to_owned());
    assert_eq!(parse_nvidia_smi(&csv).unwrap(), (gpus.collect(), driver));
    let query = "nvidia-smi --query-gpu=uuid,pci.bus_id --format=csv,noheader";
    let buses = host.exec_ok(&words(query));
    let no_reasons = health(&host, [vec![], vec![], vec![]]);
    assert_eq!(parse_nvidia_smi_bus_ids(&buses).unwrap(), no_reasons);
    let topo = parse_nvidia_topo(&host.exec_ok(&["nvidia-smi", "topo", "-m"])).unwrap();
    assert_eq!(topo.gpus(), [0, 1, 2]);
    assert_eq!(topo.link(0, 2), Some(Link::Node));
    let listed = host.exec_ok(&["nvidia-smi", "-L"]);
    let first = format!("GPU 0: {} (UUID: {})", host.gpu_name(), uuids[0]);
    assert!(listed.starts_with(&first), "{listed}");

    // Outside the namespace the same tool finds no driver, as on a host without GPUs.
    let outside = Command::new(&tool).arg("-L").output().unwrap();
    assert_eq!(outside.status.code(), Some(9));
    assert!(String::from_utf8_lossy(&outside.stdout).contains("couldn't communicate"));
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn nvidia_smi_q_reports_the_health_a_test_sets() {
    use UnhealthyReason::{RetiredPagesPending, RowRemapFailure, RowRemapPending};
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 2, |_| ());
    let report = || parse_nvidia_smi_query(&host.exec_ok(&["nvidia-smi", "-q"])).unwrap();
    assert_eq!(report(), health(&host, [vec![], vec![]]));
    host.set_health(1, FakeHealth::RowRemapPending);
    assert_eq!(report(), health(&host, [vec![], vec![RowRemapPending]]));
    host.set_health(0, FakeHealth::RetiredPagesPending);
    host.set_health(1, FakeHealth::RowRemapFailure);
    let both = [vec![RetiredPagesPending], vec![RowRemapFailure]];
    assert_eq!(report(), health(&host, both));
    host.set_health(0, FakeHealth::Healthy);
    host.set_health(1, FakeHealth::Healthy);
    assert_eq!(report(), health(&host, [vec![], vec![]]));
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_recorded_topology_is_printed_as_recorded() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 8, |o| {
        o.topology = Some("h100-nvswitch-8gpu".to_owned());
        o.cdi_names = Some(vec![]);
    });
    assert_eq!(host.spec_path(), None);
    let printed = host.exec_ok(&["nvidia-smi", "topo", "-m"]);
    let recording = "crates/shim-resources/testdata/gpu/topo/h100-nvswitch-8gpu.txt";
    let recorded = fs_err::read_to_string(shim_e2e::repo_root().join(recording)).unwrap();
    assert_eq!(printed, recorded);
    let topo = parse_nvidia_topo(&printed).unwrap();
    assert_eq!(topo.link(0, 7), Some(Link::NvLink(18)));
    assert_eq!(topo.numa_nodes(7), Some(&[1][..]));
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_container_gets_exactly_the_cdi_devices_it_asks_for() {
    require_docker_and_root();
    let names = vec![CdiName::Index, CdiName::Uuid, CdiName::Legacy];
    let host = FakeGpuHost::with(FakeVendor::Nvidia, 2, |o| o.cdi_names = Some(names));
    let spec = fs_err::read_to_string(host.spec_path().unwrap()).unwrap();
    assert!(spec.starts_with("---\ncdiVersion: 0.5.0\n"), "{spec}");
    let uuids = host.uuids();
    let by_uuid = format!("nvidia.com/gpu={}", uuids[1]);
    let names = ["nvidia.com/gpu=1", &by_uuid, "nvidia.com/gpu=gpu1"];
    assert_eq!(host.cdi_devices(1), names);
    let env = format!("DSTACK_FAKE_GPU_1={}", uuids[1]);
    // The container's nvidia-smi numbers what it sees from 0, as the real one does.
    let listed = format!("GPU 0: {} (UUID: {})", host.gpu_name(), uuids[1]);
    for device in host.cdi_devices(1) {
        let output = run_with(&[&device], &["sh", "-c", "ls -1 /dev; env; nvidia-smi -L"]);
        let present = ["nvidia1", "nvidiactl", "nvidia-uvm", &env, &listed];
        assert_lines(&device, &output, &present, &["nvidia0"]);
        assert!(!output.contains("DSTACK_FAKE_GPU_0="), "{device}: {output}");
    }
    let all = run_with(&["nvidia.com/gpu=all"], &NVIDIA_SMI_LIST);
    let (gpus, _) = parse_nvidia_smi(&all).unwrap();
    assert_eq!(gpus.into_iter().map(|g| g.id).collect::<Vec<_>>(), uuids);
    // Without a device request a container sees no GPU.
    let none = run_with(&[], &["ls", "-1", "/dev"]);
    assert!(!none.contains("nvidia"), "{none}");
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn amd_smi_runs_as_the_shim_runs_it() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Amd, 2, |_| ());
    assert_eq!(host.images(), ["dstackai/amd-smi:latest"]);
    // As the shim runs it (`GpuDetector::amd_smi`), from inside the fake host, where the
    // docker of PATH hands the engine the fake nodes' host paths.
    let json = host.exec_ok(&words(
        "docker run --rm --device /dev/kfd --device /dev/dri dstackai/amd-smi:latest \
         static --json --asic --vram --bus --driver",
    ));
    let gpus = host.bus_ids().into_iter().map(|bdf| AmdGpu {
        name: host.gpu_name(),
        memory_mib: 262_128,
        bdf,
    });
    let driver = Some("6.10.5".to_owned());
    assert_eq!(parse_amd_smi(&json).unwrap(), (gpus.collect(), driver));
    // Without the devices the tool fails, as the real one does.
    let bare = words("docker run --rm dstackai/amd-smi:latest static --json");
    let bare = host.exec(&bare);
    assert!(!bare.status.success());
    // The shim's render node lookup: /dev/dri/by-path/pci-<bdf>-render.
    for (bdf, id) in host.bus_ids().iter().zip(host.ids()) {
        let link = format!("/dev/dri/by-path/pci-{bdf}-render");
        assert_eq!(host.exec_ok(&["readlink", "-f", &link]).trim(), id);
    }
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn an_amd_container_gets_its_gpus_nodes_through_cdi() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Amd, 2, |_| ());
    assert_eq!(host.cdi_devices(1), ["amd.com/gpu=1"]);
    let output = run_with(
        &["amd.com/gpu=1"],
        &["sh", "-c", "ls -1 /dev /dev/dri; env"],
    );
    let env = "DSTACK_FAKE_GPU_1=/dev/dri/renderD129";
    let present = ["kfd", "card1", "renderD129", env];
    assert_lines("amd.com/gpu=1", &output, &present, &["renderD128"]);
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn tt_smi_runs_as_the_shim_runs_it() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Tenstorrent, 2, |_| ());
    assert_eq!(host.spec_path(), None);
    let run = words("docker run --rm --device /dev/tenstorrent dstackai/tt-smi:latest -s");
    let gpus = parse_tt_smi(&host.exec_ok(&run)).unwrap();
    let ids: Vec<&str> = gpus.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(ids, ["0", "1"]);
    let version = host.exec_ok(&["cat", "/sys/module/tenstorrent/version"]);
    assert_eq!(version.trim(), "1.33");
}

/// Starts the shim inside `host` as a service (so that it writes `host_info.json`) and
/// returns what it wrote once it has.
fn shim_host_info(host: &FakeGpuHost, label: &str) -> serde_json::Value {
    let shim = TestShim::builder(label).gpu_host(host);
    let shim = shim.args(["--service"]).start();
    let path = shim.home().join("host_info.json");
    let info = wait_for("the shim writes host_info.json", BOUND, || {
        let text = fs_err::read_to_string(&path).map_err(|e| e.to_string())?;
        serde_json::from_str(&text).map_err(|e| e.to_string())
    });
    // The shim itself ran the vendor tool: an API request still answers.
    assert!(shim.api().answers());
    info
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn the_shim_detects_the_fake_gpus_as_a_real_hosts() {
    require_docker_and_root();
    for (vendor, n) in [
        (FakeVendor::Nvidia, 4),
        (FakeVendor::Amd, 2),
        (FakeVendor::Tenstorrent, 3),
    ] {
        let host = FakeGpuHost::with(vendor, n, |_| ());
        let info = shim_host_info(&host, &format!("gpu-host-{}", vendor.as_str()));
        assert_eq!(info["gpu_vendor"], vendor.as_str(), "{info}");
        assert_eq!(info["gpu_count"], n, "{info}");
        assert_eq!(info["gpu_name"], host.gpu_name().as_str(), "{info}");
        assert_eq!(info["gpu_memory"], host.gpu_memory_mib(), "{info}");
    }
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn teardown_leaves_nothing_and_frees_the_lock() {
    require_docker_and_root();
    let host = FakeGpuHost::with(FakeVendor::Amd, 2, |_| ());
    let dir = host.dir().to_owned();
    let spec = host.spec_path().unwrap();
    let key = host.record()["key"].as_str().unwrap().to_owned();
    let record = format!("/var/lib/dstack-shim-dev/fake-gpu-hosts/{key}.json").into();
    for made in [&dir, &spec, &record] {
        assert!(made.exists(), "{}", made.display());
    }
    let images = image_ids(&host);
    assert_eq!(images.len(), 1);
    assert!(image_exists(&images[0]));
    let holder = host.holder_pid().unwrap();
    assert!(!gone(holder));

    // Another fake host waits for this one (here: gives up after a second).
    let options = FakeGpuHostOptions {
        lock_timeout: Some(Duration::from_secs(1)),
        ..FakeGpuHostOptions::default()
    };
    let second = FakeGpuHost::try_setup(FakeVendor::Nvidia, 1, &options);
    let err = second.expect_err("a second fake host while the first lives");
    assert!(err.to_string().contains("lock"), "{err}");

    host.teardown().unwrap();
    for made in [&dir, &spec, &record] {
        assert!(!made.exists(), "{} left", made.display());
    }
    assert!(!image_exists(&images[0]));
    assert!(gone(holder), "the lock holder {holder} still runs");
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_dead_owners_host_is_torn_down_by_its_holder() {
    require_docker_and_root();
    // A process that lives until killed: the host's owner.
    let mut owner = Command::new("sleep").arg("600").spawn().unwrap();
    let owner_pid = Some(owner.id());
    let host = FakeGpuHost::with(FakeVendor::Tenstorrent, 1, |o| o.owner_pid = owner_pid);
    let dir = host.dir().to_owned();
    let images = image_ids(&host);
    assert!(image_exists(&images[0]));
    // The owner dies without a teardown, as a killed test does.
    owner.kill().unwrap();
    owner.wait().unwrap();
    wait_until("the holder tears the host down and exits", BOUND, || {
        !dir.exists() && gone(host.holder_pid().expect("a holder"))
    });
    assert!(!image_exists(&images[0]));
    // Nothing is left for this value's own teardown to do.
    host.teardown().unwrap();
}
