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

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use shim_e2e::harness::{
    CdiName, FakeGpuHost, FakeGpuHostOptions, FakeHealth, FakeVendor, TestShim, docker_socket,
    run_with_cdi_devices, wait_for, wait_until,
};
use shim_e2e::{image, require_docker, require_root};
use shim_resources::gpu::health::{parse_nvidia_smi_bus_ids, parse_nvidia_smi_query};
use shim_resources::gpu::parse_nvidia_smi;
use shim_resources::gpu::{Link, UnhealthyReason, parse_amd_smi, parse_nvidia_topo, parse_tt_smi};

/// The shim's `nvidia-smi` list invocation (`shim_resources::gpu::detect`).
const NVIDIA_SMI_LIST: [&str; 3] = [
    "nvidia-smi",
    "--query-gpu=name,memory.total,uuid,driver_version",
    "--format=csv,noheader,nounits",
];
/// The bound of the waits below (a teardown by the holder, the shim's host info).
const BOUND: Duration = Duration::from_secs(60);

fn options() -> FakeGpuHostOptions {
    FakeGpuHostOptions::default()
}

/// Whether `reference` is an image of the engine at `DOCKER_HOST`.
fn image_exists(reference: &str) -> bool {
    Command::new("docker")
        .args(["image", "inspect", reference])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Whether the fake host's lock holder has exited (the lock is then its no more; another
/// test's fake host may hold it already). A zombie has no command line.
fn holder_gone(host: &FakeGpuHost) -> bool {
    let pid = host.holder_pid().expect("a holder");
    fs_err::read(format!("/proc/{pid}/cmdline")).map_or(true, |cmdline| cmdline.is_empty())
}

/// The ids of the images `host` imported. Tests running beside this one import images of the
/// same names once this host is gone, so what is checked is that these ids are gone.
fn image_ids(host: &FakeGpuHost) -> Vec<String> {
    host.record()["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn exec_shows_an_nvidia_host_that_the_host_itself_does_not_have() {
    require_docker();
    require_root();
    assert!(
        !Path::new("/dev/nvidiactl").exists(),
        "this machine has an NVIDIA driver: the fake host would hide nothing"
    );
    let host = FakeGpuHost::setup(FakeVendor::Nvidia, 3, &options());
    let uuids = host.uuids();
    assert_eq!(uuids.len(), 3);
    assert!(
        uuids.iter().all(|u| u.starts_with("GPU-") && u.len() == 40),
        "{uuids:?}"
    );

    // The nodes at their real paths, nvidia-smi first in PATH, for the command and its
    // children (a shell, here).
    let seen = host.exec_ok(&[
        "sh",
        "-c",
        "ls /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia0 /dev/nvidia1 /dev/nvidia2 && \
         command -v nvidia-smi",
    ]);
    assert!(
        seen.contains(&format!("{}/bin/nvidia-smi", host.dir().display())),
        "{seen}"
    );
    assert!(
        !Path::new("/dev/nvidiactl").exists(),
        "the host's /dev changed"
    );

    // The shim's invocations, read by the shim's own parsers.
    let csv = host.exec_ok(&NVIDIA_SMI_LIST);
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let (gpus, driver) = parse_nvidia_smi(&csv).unwrap();
    assert_eq!(gpus.iter().map(|g| g.id.clone()).collect::<Vec<_>>(), uuids);
    assert!(
        gpus.iter()
            .all(|g| g.name == host.gpu_name() && g.memory_mib == 81920)
    );
    assert_eq!(driver.as_deref(), Some("535.129.03"));
    let buses = host.exec_ok(&[
        "nvidia-smi",
        "--query-gpu=uuid,pci.bus_id",
        "--format=csv,noheader",
    ]);
    let buses = parse_nvidia_smi_bus_ids(&buses).unwrap();
    assert_eq!(
        buses.iter().map(|g| g.bus_id.clone()).collect::<Vec<_>>(),
        host.bus_ids()
    );
    let topo = parse_nvidia_topo(&host.exec_ok(&["nvidia-smi", "topo", "-m"])).unwrap();
    assert_eq!(topo.gpus(), [0, 1, 2]);
    assert_eq!(topo.link(0, 2), Some(Link::Node));
    let listed = host.exec_ok(&["nvidia-smi", "-L"]);
    assert!(
        listed.starts_with(&format!("GPU 0: {} (UUID: {})", host.gpu_name(), uuids[0])),
        "{listed}"
    );

    // Outside the namespace the same tool finds no driver, as on a host without GPUs.
    let outside = Command::new(host.dir().join("bin/nvidia-smi"))
        .arg("-L")
        .output()
        .unwrap();
    assert_eq!(outside.status.code(), Some(9));
    assert!(String::from_utf8_lossy(&outside.stdout).contains("couldn't communicate"));
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn nvidia_smi_q_reports_the_health_a_test_sets() {
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(FakeVendor::Nvidia, 2, &options());
    let reasons = || -> Vec<Vec<UnhealthyReason>> {
        let report = parse_nvidia_smi_query(&host.exec_ok(&["nvidia-smi", "-q"])).unwrap();
        assert_eq!(
            report.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>(),
            host.uuids()
        );
        assert_eq!(
            report.iter().map(|g| g.bus_id.clone()).collect::<Vec<_>>(),
            host.bus_ids()
        );
        report.into_iter().map(|g| g.reasons).collect()
    };
    assert_eq!(reasons(), [vec![], vec![]]);
    host.set_health(1, FakeHealth::RowRemapPending);
    assert_eq!(reasons(), [vec![], vec![UnhealthyReason::RowRemapPending]]);
    host.set_health(0, FakeHealth::RetiredPagesPending);
    host.set_health(1, FakeHealth::RowRemapFailure);
    assert_eq!(
        reasons(),
        [
            vec![UnhealthyReason::RetiredPagesPending],
            vec![UnhealthyReason::RowRemapFailure]
        ]
    );
    host.set_health(0, FakeHealth::Healthy);
    host.set_health(1, FakeHealth::Healthy);
    assert_eq!(reasons(), [vec![], vec![]]);
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_recorded_topology_is_printed_as_recorded() {
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(
        FakeVendor::Nvidia,
        8,
        &FakeGpuHostOptions {
            topology: Some("h100-nvswitch-8gpu".to_owned()),
            cdi_names: Some(vec![]),
            ..options()
        },
    );
    assert_eq!(host.spec_path(), None);
    let printed = host.exec_ok(&["nvidia-smi", "topo", "-m"]);
    let recorded = fs_err::read_to_string(
        shim_e2e::repo_root()
            .join("crates/shim-resources/testdata/gpu/topo/h100-nvswitch-8gpu.txt"),
    )
    .unwrap();
    assert_eq!(printed, recorded);
    let topo = parse_nvidia_topo(&printed).unwrap();
    assert_eq!(topo.link(0, 7), Some(Link::NvLink(18)));
    assert_eq!(topo.numa_nodes(7), Some(&[1][..]));
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_container_gets_exactly_the_cdi_devices_it_asks_for() {
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(
        FakeVendor::Nvidia,
        2,
        &FakeGpuHostOptions {
            cdi_names: Some(vec![CdiName::Index, CdiName::Uuid, CdiName::Legacy]),
            ..options()
        },
    );
    let spec = fs_err::read_to_string(host.spec_path().unwrap()).unwrap();
    assert!(spec.starts_with("---\ncdiVersion: 0.5.0\n"), "{spec}");
    let uuids = host.uuids();
    assert_eq!(
        host.cdi_devices(1),
        [
            "nvidia.com/gpu=1".to_owned(),
            format!("nvidia.com/gpu={}", uuids[1]),
            "nvidia.com/gpu=gpu1".to_owned()
        ]
    );
    let script = "ls -1 /dev; env; nvidia-smi -L";
    for device in host.cdi_devices(1) {
        let run = run_with_cdi_devices(
            &docker_socket(),
            &image(),
            &[&device],
            &["sh", "-c", script],
        )
        .unwrap();
        assert_eq!(run.exit_code, 0, "{device}: {}", run.output);
        let lines: Vec<&str> = run.output.lines().collect();
        for present in ["nvidia1", "nvidiactl", "nvidia-uvm"] {
            assert!(
                lines.contains(&present),
                "{device}: no /dev/{present}: {}",
                run.output
            );
        }
        assert!(
            !lines.contains(&"nvidia0"),
            "{device}: /dev/nvidia0 too: {}",
            run.output
        );
        assert!(lines.contains(&format!("DSTACK_FAKE_GPU_1={}", uuids[1]).as_str()));
        assert!(!run.output.contains("DSTACK_FAKE_GPU_0="), "{}", run.output);
        // The container's nvidia-smi numbers what it sees from 0, as the real one does.
        assert!(
            lines.contains(&format!("GPU 0: {} (UUID: {})", host.gpu_name(), uuids[1]).as_str()),
            "{}",
            run.output
        );
    }
    let all = run_with_cdi_devices(
        &docker_socket(),
        &image(),
        &["nvidia.com/gpu=all"],
        &NVIDIA_SMI_LIST,
    )
    .unwrap();
    assert_eq!(all.exit_code, 0, "{}", all.output);
    let (gpus, _) = parse_nvidia_smi(&all.output).unwrap();
    assert_eq!(gpus.into_iter().map(|g| g.id).collect::<Vec<_>>(), uuids);
    // Without a device request a container sees no GPU.
    let none =
        run_with_cdi_devices(&docker_socket(), &image(), &[], &["ls", "-1", "/dev"]).unwrap();
    assert!(!none.output.contains("nvidia"), "{}", none.output);
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn amd_smi_runs_as_the_shim_runs_it() {
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(FakeVendor::Amd, 2, &options());
    assert_eq!(host.images(), ["dstackai/amd-smi:latest"]);
    // As the shim runs it (`GpuDetector::amd_smi`), from inside the fake host, where the
    // docker of PATH hands the engine the fake nodes' host paths.
    let json = host.exec_ok(&[
        "docker",
        "run",
        "--rm",
        "--device",
        "/dev/kfd",
        "--device",
        "/dev/dri",
        "dstackai/amd-smi:latest",
        "static",
        "--json",
        "--asic",
        "--vram",
        "--bus",
        "--driver",
    ]);
    let (gpus, driver) = parse_amd_smi(&json).unwrap();
    assert_eq!(
        gpus.iter().map(|g| g.bdf.clone()).collect::<Vec<_>>(),
        host.bus_ids()
    );
    assert!(
        gpus.iter()
            .all(|g| g.name == host.gpu_name() && g.memory_mib == 262_128)
    );
    assert_eq!(driver.as_deref(), Some("6.10.5"));
    // Without the devices the tool fails, as the real one does.
    let bare = host.exec(&[
        "docker",
        "run",
        "--rm",
        "dstackai/amd-smi:latest",
        "static",
        "--json",
    ]);
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
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(FakeVendor::Amd, 2, &options());
    assert_eq!(host.cdi_devices(1), ["amd.com/gpu=1"]);
    let run = run_with_cdi_devices(
        &docker_socket(),
        &image(),
        &["amd.com/gpu=1"],
        &["sh", "-c", "ls -1 /dev /dev/dri; env"],
    )
    .unwrap();
    assert_eq!(run.exit_code, 0, "{}", run.output);
    let lines: Vec<&str> = run.output.lines().collect();
    for present in ["kfd", "card1", "renderD129"] {
        assert!(lines.contains(&present), "no {present}: {}", run.output);
    }
    assert!(!lines.contains(&"renderD128"), "{}", run.output);
    assert!(
        lines.contains(&"DSTACK_FAKE_GPU_1=/dev/dri/renderD129"),
        "{}",
        run.output
    );
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn tt_smi_runs_as_the_shim_runs_it() {
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(FakeVendor::Tenstorrent, 2, &options());
    assert_eq!(host.spec_path(), None);
    let json = host.exec_ok(&[
        "docker",
        "run",
        "--rm",
        "--device",
        "/dev/tenstorrent",
        "dstackai/tt-smi:latest",
        "-s",
    ]);
    let gpus = parse_tt_smi(&json).unwrap();
    assert_eq!(
        gpus.iter().map(|g| g.id.clone()).collect::<Vec<_>>(),
        ["0", "1"]
    );
    assert_eq!(
        host.exec_ok(&["cat", "/sys/module/tenstorrent/version"])
            .trim(),
        "1.33"
    );
}

/// Starts the shim inside `host` as a service (so that it writes `host_info.json`) and
/// returns what it wrote once it has.
fn shim_host_info(host: &FakeGpuHost, label: &str) -> serde_json::Value {
    let shim = TestShim::builder(label)
        .gpu_host(host)
        .args(["--service"])
        .start();
    let path = shim.home().join("host_info.json");
    let info = wait_for("the shim writes host_info.json", BOUND, || {
        fs_err::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|text| serde_json::from_str(&text).map_err(|e| e.to_string()))
    });
    // The shim itself ran the vendor tool: an API request still answers.
    assert!(shim.api().answers());
    info
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn the_shim_detects_the_fake_gpus_as_a_real_hosts() {
    require_docker();
    require_root();
    for (vendor, n) in [
        (FakeVendor::Nvidia, 4),
        (FakeVendor::Amd, 2),
        (FakeVendor::Tenstorrent, 3),
    ] {
        let host = FakeGpuHost::setup(vendor, n, &options());
        let info = shim_host_info(&host, &format!("gpu-host-{}", vendor.as_str()));
        assert_eq!(info["gpu_vendor"], vendor.as_str(), "{info}");
        assert_eq!(info["gpu_count"], n, "{info}");
        assert_eq!(info["gpu_name"], host.gpu_name().as_str(), "{info}");
        assert_eq!(info["gpu_memory"], host.gpu_memory_mib(), "{info}");
    }
}

/// A process that lives until killed: the owner of a fake host in the tests below.
fn owner() -> Child {
    Command::new("sleep").arg("600").spawn().unwrap()
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn teardown_leaves_nothing_and_frees_the_lock() {
    require_docker();
    require_root();
    let host = FakeGpuHost::setup(FakeVendor::Amd, 2, &options());
    let dir = host.dir().to_owned();
    let spec = host.spec_path().unwrap();
    let record = PathBuf::from("/var/lib/dstack-shim-dev/fake-gpu-hosts")
        .join(format!("{}.json", host.record()["key"].as_str().unwrap()));
    for made in [&dir, &spec, &record] {
        assert!(made.exists(), "{}", made.display());
    }
    let images = image_ids(&host);
    assert_eq!(images.len(), 1);
    assert!(image_exists(&images[0]));
    assert!(!holder_gone(&host));

    // Another fake host waits for this one (here: gives up after a second).
    let second = FakeGpuHost::try_setup(
        FakeVendor::Nvidia,
        1,
        &FakeGpuHostOptions {
            lock_timeout: Some(Duration::from_secs(1)),
            ..options()
        },
    );
    let err = second.expect_err("a second fake host while the first lives");
    assert!(err.to_string().contains("lock"), "{err}");

    let holder = host.holder_pid().unwrap();
    host.teardown().unwrap();
    for made in [&dir, &spec, &record] {
        assert!(!made.exists(), "{} left", made.display());
    }
    assert!(!image_exists(&images[0]));
    let cmdline = fs_err::read(format!("/proc/{holder}/cmdline")).unwrap_or_default();
    assert!(cmdline.is_empty(), "the lock holder {holder} still runs");
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_dead_owners_host_is_torn_down_by_its_holder() {
    require_docker();
    require_root();
    let mut owner = owner();
    let host = FakeGpuHost::setup(
        FakeVendor::Tenstorrent,
        1,
        &FakeGpuHostOptions {
            owner_pid: Some(owner.id()),
            ..options()
        },
    );
    let dir = host.dir().to_owned();
    let images = image_ids(&host);
    assert!(image_exists(&images[0]));
    // The owner dies without a teardown, as a killed test does.
    owner.kill().unwrap();
    owner.wait().unwrap();
    wait_until("the holder tears the host down and exits", BOUND, || {
        !dir.exists() && holder_gone(&host)
    });
    assert!(!image_exists(&images[0]));
    // Nothing is left for this value's own teardown to do.
    host.teardown().unwrap();
}
