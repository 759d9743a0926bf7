//! GPU detection against a fake device root and recorded tool outputs; the lock. Detection
//! order, tool arguments and parsing follow dstack's Go shim, cited where pinned.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shim_resources::gpu::{
    AMD_SMI_IMAGE, GpuInfo, TT_SMI_IMAGE, parse_amd_smi, parse_hl_smi, parse_nvidia_smi,
    parse_nvidia_topo, parse_tt_smi,
};
use shim_resources::{GpuDetector, GpuLock, GpuVendor, HostGpus, ResourcesError};
use shim_util::CommandOutput;
use shim_util::fake::ScriptedCommandRunner;

/// `testdata/gpu/<name>`.
fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/gpu")
        .join(name);
    fs_err::read_to_string(p).unwrap()
}

struct FakeHost {
    tmp: tempfile::TempDir,
    runner: Arc<ScriptedCommandRunner>,
}

impl FakeHost {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        for d in ["dev", "sys", "wsl"] {
            fs_err::create_dir(tmp.path().join(d)).unwrap();
        }
        Self {
            tmp,
            runner: Arc::new(ScriptedCommandRunner::new()),
        }
    }

    /// A host whose `/dev` has the file `rel` (e.g. `nvidiactl`, `kfd`).
    fn with_dev(rel: &str) -> Self {
        let h = Self::new();
        h.touch_dev(rel);
        h
    }

    fn dev(&self) -> PathBuf {
        self.tmp.path().join("dev")
    }

    fn touch_dev(&self, rel: &str) {
        let p = self.dev().join(rel);
        fs_err::create_dir_all(p.parent().unwrap()).unwrap();
        fs_err::write(p, "").unwrap();
    }

    fn mkdir_dev(&self, rel: &str) {
        fs_err::create_dir_all(self.dev().join(rel)).unwrap();
    }

    fn wsl_nvidia_smi(&self) -> PathBuf {
        self.tmp.path().join("wsl/nvidia-smi")
    }

    fn detector(&self) -> GpuDetector {
        GpuDetector::new(self.runner.clone())
            .with_dev_root(self.dev())
            .with_sys_root(self.tmp.path().join("sys"))
            .with_wsl_nvidia_smi(self.wsl_nvidia_smi())
    }

    fn vendor(&self) -> Option<GpuVendor> {
        self.detector().detect_vendor()
    }

    async fn detect(&self) -> HostGpus {
        self.detector().detect().await
    }

    /// The next run of `program` succeeds, printing the fixture `name`.
    fn answer(&self, program: &str, name: &str) {
        self.runner.push(program, CommandOutput::ok(fixture(name)));
    }

    /// Asserts that the `n`th command run was `command_line` (split at its spaces).
    #[track_caller]
    fn assert_call(&self, n: usize, command_line: &str) {
        let calls = self.runner.calls();
        assert_eq!(calls[n], command_line.split(' ').collect::<Vec<_>>());
    }

    fn tt_driver_version(&self, v: &str) {
        let d = self.tmp.path().join("sys/module/tenstorrent");
        fs_err::create_dir_all(&d).unwrap();
        fs_err::write(d.join("version"), v).unwrap();
    }
}

#[test]
fn vendor_detection_order() {
    // upstream: runner/internal/common/gpu/gpu.go (GetGpuVendor): /dev/nvidiactl, then
    // /dev/dxg with /usr/lib/wsl/lib/nvidia-smi, /dev/tenstorrent, /dev/kfd, /dev/accel.
    let h = FakeHost::new();
    assert_eq!(h.vendor(), None);
    h.touch_dev("accel");
    assert_eq!(h.vendor(), Some(GpuVendor::Intel));
    h.touch_dev("kfd");
    assert_eq!(h.vendor(), Some(GpuVendor::Amd));
    h.mkdir_dev("tenstorrent");
    assert_eq!(h.vendor(), Some(GpuVendor::Tenstorrent));
    // WSL: /dev/dxg alone is not NVIDIA; with WSL's nvidia-smi it is.
    h.touch_dev("dxg");
    assert_eq!(h.vendor(), Some(GpuVendor::Tenstorrent));
    fs_err::write(h.wsl_nvidia_smi(), "").unwrap();
    assert_eq!(h.vendor(), Some(GpuVendor::Nvidia));
    // An NVIDIA dGPU beside an AMD iGPU is NVIDIA (dstack issue 4085).
    let h2 = FakeHost::with_dev("kfd");
    h2.touch_dev("nvidiactl");
    assert_eq!(h2.vendor(), Some(GpuVendor::Nvidia));
    // checkPath stats (follows links): a dangling link is absent, a link to a node present.
    let h3 = FakeHost::new();
    std::os::unix::fs::symlink("/nonexistent/nvidiactl", h3.dev().join("nvidiactl")).unwrap();
    assert_eq!(h3.vendor(), None);
    h3.touch_dev("real-kfd");
    std::os::unix::fs::symlink(h3.dev().join("real-kfd"), h3.dev().join("kfd")).unwrap();
    assert_eq!(h3.vendor(), Some(GpuVendor::Amd));
}

#[tokio::test]
async fn nvidia_from_nvidia_smi() {
    let h = FakeHost::with_dev("nvidiactl");
    h.answer("nvidia-smi", "nvidia-smi.csv");
    let gpus = h.detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Nvidia));
    assert_eq!(gpus.driver_version.as_deref(), Some("570.86.15"));
    assert_eq!(gpus.gpus.len(), 2);
    assert_eq!(gpus.gpus[0].name, "NVIDIA H100 80GB HBM3");
    assert_eq!(gpus.gpus[0].memory_mib, 81559);
    assert_eq!(gpus.gpus[1].id, "GPU-7a1c9e02-5b3d-4a51-9c0e-1f2d3e4a5b6c");
    assert_eq!(gpus.gpus[1].index, 1);
    // upstream: runner/internal/shim/host/gpu.go (getNvidiaGpuInfo), with the index asked too.
    h.assert_call(
        0,
        "nvidia-smi --query-gpu=index,name,memory.total,uuid,driver_version \
         --format=csv,noheader,nounits",
    );
}

/// One GPU the driver cannot reach (fallen off the bus after XID 79, or needing a reset) is
/// an error line in its place and a failed exit; the others are listed all the same and are
/// the host's GPUs, each with its own index. The whole list used to fail, leaving the host
/// with no GPU until the shim restarted.
#[tokio::test]
async fn a_gpu_the_driver_cannot_reach_leaves_the_others_listed() {
    let h = FakeHost::with_dev("nvidiactl");
    let listed = "0, NVIDIA H100 80GB HBM3, 81559, GPU-0f4e2b1c, 550.90.07\n\
                  Unable to determine the device handle for GPU1: 0000:2A:00.0: Unknown Error\n\
                  2, NVIDIA H100 80GB HBM3, 81559, GPU-2a9c4d7e, 550.90.07\n";
    let exit_15 = CommandOutput::exit(15, "");
    h.runner.push("nvidia-smi", exit_15.with_stdout(listed));
    let gpus = h.detect().await;
    let found: Vec<_> = gpus.gpus.iter().map(|g| (g.index, g.id.as_str())).collect();
    assert_eq!(found, [(0, "GPU-0f4e2b1c"), (2, "GPU-2a9c4d7e")]);
    assert_eq!(gpus.driver_version.as_deref(), Some("550.90.07"));
}

#[tokio::test]
async fn failing_tool_yields_vendor_without_gpus() {
    let h = FakeHost::with_dev("nvidiactl");
    let failure = CommandOutput::exit(9, "NVIDIA-SMI has failed");
    h.runner.push("nvidia-smi", failure);
    let gpus = h.detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Nvidia));
    assert!(gpus.gpus.is_empty());
    assert!(gpus.driver_version.is_none());
}

#[test]
fn nvidia_parse_errors_and_placeholders() {
    assert!(parse_nvidia_smi("0, a, 1, GPU-x\n").is_err(), "no GPU line");
    let no_index = parse_nvidia_smi("x, a, 1, GPU-x, 570\n");
    assert!(no_index.is_err(), "no index");
    // upstream: runner/internal/shim/host/gpu.go (normalizeDriverVersion, Atoi → 0).
    let (gpus, driver) = parse_nvidia_smi("0, Tesla T4, [N/A], GPU-1, [Not Supported]\n").unwrap();
    assert_eq!(gpus[0].memory_mib, 0);
    assert_eq!(driver, None);
    let (_, driver) = parse_nvidia_smi("0, T4, 1, GPU-1,  570.86.15 \n").unwrap();
    assert_eq!(driver.as_deref(), Some("570.86.15"));
    assert!(parse_nvidia_smi("").unwrap().0.is_empty());
}

/// Render nodes `/dev/dri/renderD<n>`, each linked from `/dev/dri/by-path/pci-<bdf>-render`.
fn render_nodes(h: &FakeHost, bdfs: &[(&str, u32)]) {
    h.mkdir_dev("dri/by-path");
    for (bdf, n) in bdfs {
        h.touch_dev(&format!("dri/renderD{n}"));
        std::os::unix::fs::symlink(
            format!("../renderD{n}"),
            h.dev().join(format!("dri/by-path/pci-{bdf}-render")),
        )
        .unwrap();
    }
}

/// upstream: runner/internal/shim/host/gpu.go (execAmdSmiStatic).
fn amd_smi_call() -> String {
    format!(
        "docker run --rm --device /dev/kfd --device /dev/dri {AMD_SMI_IMAGE} \
         static --json --asic --vram --bus"
    )
}

#[tokio::test]
async fn amd_via_docker_with_fallback_without_driver_option() {
    let h = FakeHost::with_dev("kfd");
    render_nodes(&h, &[("0000:5f:00.0", 128), ("0000:75:00.0", 136)]);
    // An amd-smi that rejects --driver exits non-zero; then it answers without it.
    let rejected = CommandOutput::exit(2, "unrecognized arguments: --driver");
    h.runner.push("docker", rejected);
    h.answer("docker", "amd-smi-rocm6.json");
    let gpus = h.detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Amd));
    assert_eq!(gpus.driver_version, None);
    let dri = fs_err::canonicalize(h.dev().join("dri")).unwrap();
    let mi300x = |node: &str| {
        let id = dri.join(node).to_string_lossy().into_owned();
        ("AMD Instinct MI300X".to_owned(), 196_592, id)
    };
    let want = [mi300x("renderD128"), mi300x("renderD136")];
    assert_eq!(summary(&gpus.gpus), want);
    assert_eq!(h.runner.calls().len(), 2);
    h.assert_call(0, &format!("{} --driver", amd_smi_call()));
    h.assert_call(1, &amd_smi_call());
}

#[tokio::test]
async fn amd_does_not_retry_when_docker_cannot_run() {
    // upstream: only an amd-smi that exited with an error is retried without --driver.
    let h = FakeHost::with_dev("kfd");
    h.runner.push_spawn_error("docker", "docker: not found");
    let gpus = h.detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Amd));
    assert!(gpus.gpus.is_empty());
    assert_eq!(h.runner.count("docker"), 1);
}

#[tokio::test]
async fn amd_rocm7_object() {
    let h = FakeHost::with_dev("kfd");
    render_nodes(&h, &[("0000:05:00.0", 128)]);
    h.answer("docker", "amd-smi-rocm7.json");
    let gpus = h.detect().await;
    assert_eq!(gpus.driver_version.as_deref(), Some("6.10.5"));
    assert_eq!(gpus.gpus.len(), 1);
    assert_eq!(gpus.gpus[0].name, "AMD Instinct MI325X");
    assert!(gpus.gpus[0].id.ends_with("/dri/renderD128"));
}

#[test]
fn amd_parse_shapes() {
    let (g6, d6) = parse_amd_smi(&fixture("amd-smi-rocm6.json")).unwrap();
    assert_eq!((g6.len(), d6), (2, None));
    assert_eq!(g6[1].bdf, "0000:75:00.0");
    let (g7, d7) = parse_amd_smi(&fixture("amd-smi-rocm7.json")).unwrap();
    assert_eq!((g7.len(), d7.as_deref()), (1, Some("6.10.5")));
    assert!(parse_amd_smi(r#"{"other": 1}"#).is_err());
    assert!(parse_amd_smi("not json").is_err());
}

#[test]
fn amd_driver_versions_as_upstream() {
    // upstream: runner/internal/shim/host/gpu_test.go (TestParseAmdSmiOutputWithDriver).
    // One GPU whose `driver` field is `driver` (no such field when empty).
    let gpu = |driver: &str| {
        let driver = match driver {
            "" => String::new(),
            d => format!(r#", "driver": {d}"#),
        };
        format!(
            r#"[{{"gpu": 0, "asic": {{"market_name": "MI300X"}}, "vram": {{"size": {{"value": 196592}}}}, "bus": {{"bdf": "0000:05:00.0"}}{driver}}}]"#
        )
    };
    let cases = [
        (r#"{"name": "amdgpu", "version": "6.10.5"}"#, Some("6.10.5")),
        (
            r#"{"version": "6.10.5", "driver_version": "6.8.5"}"#,
            Some("6.10.5"),
        ),
        (
            r#"{"NAME": "amdgpu", "VERSION": "6.12.12"}"#,
            Some("6.12.12"),
        ),
        (
            r#"{"driver_name": "amdgpu", "driver_version": "6.8.5"}"#,
            Some("6.8.5"),
        ),
        ("", None),
        (r#""amdgpu 6.8.5""#, None),
        (r#"{"name": "N/A", "version": "N/A"}"#, None),
        (
            r#"{"version": "N/A", "driver_version": "6.8.5"}"#,
            Some("6.8.5"),
        ),
    ];
    for (driver, want) in cases {
        let (gpus, got) = parse_amd_smi(&gpu(driver)).unwrap();
        assert_eq!(gpus.len(), 1, "{driver}");
        assert_eq!(gpus[0].name, "MI300X");
        assert_eq!(got.as_deref(), want, "{driver}");
    }
    let wrapped = format!(r#"{{"gpu_data": {}}}"#, gpu(cases[2].0));
    let (_, driver) = parse_amd_smi(&wrapped).unwrap();
    assert_eq!(driver.as_deref(), Some("6.12.12"));
}

#[tokio::test]
async fn amd_gpu_without_render_node_is_skipped() {
    let h = FakeHost::with_dev("kfd");
    render_nodes(&h, &[("0000:5f:00.0", 128)]);
    h.answer("docker", "amd-smi-rocm6.json");
    let gpus = h.detect().await;
    assert_eq!(gpus.gpus.len(), 1);
    assert_eq!(gpus.gpus[0].index, 0);
}

#[tokio::test]
async fn tenstorrent_via_docker_with_the_driver_version_file() {
    let h = FakeHost::new();
    h.mkdir_dev("tenstorrent");
    h.answer("docker", "tt-smi-n300x2.json");
    let gpus = h.detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Tenstorrent));
    // upstream: runner/internal/shim/host/gpu.go (getTenstorrentGpuInfo).
    h.assert_call(
        0,
        &format!("docker run --rm --device /dev/tenstorrent {TT_SMI_IMAGE} -s"),
    );
    let l_and_r_chips = alike(2, "n300", 24);
    assert_eq!(summary(&gpus.gpus), l_and_r_chips);
    // upstream (getTenstorrentDriverVersion): only /sys/module/tenstorrent/version counts,
    // not tt-smi's host_info.Driver ("TT-KMD 1.34" in this fixture).
    assert_eq!(gpus.driver_version, None);
    h.tt_driver_version("2.0.0\n");
    h.answer("docker", "tt-smi-n300x2.json");
    assert_eq!(h.detect().await.driver_version.as_deref(), Some("2.0.0"));
}

fn tt(file: &str) -> Vec<GpuInfo> {
    parse_tt_smi(&fixture(&format!("tenstorrent/{file}"))).unwrap()
}

/// tt-smi's answer listing boards of (type, board id, bus id), parsed, as [`summary`].
fn tt_devices(devices: &[(&str, &str, &str)]) -> Vec<(String, u64, String)> {
    let list: Vec<serde_json::Value> = devices
        .iter()
        .map(|(t, id, bus)| {
            serde_json::json!({"board_info": {"board_type": t, "board_id": id, "bus_id": bus}})
        })
        .collect();
    summary(&parse_tt_smi(&serde_json::json!({ "device_info": list }).to_string()).unwrap())
}

/// Each GPU as (name, memory in MiB, id).
fn summary(gpus: &[GpuInfo]) -> Vec<(String, u64, String)> {
    gpus.iter()
        .map(|g| (g.name.clone(), g.memory_mib, g.id.clone()))
        .collect()
}

/// A GPU of [`summary`] with `gib` GiB and the id `id`.
fn s(name: &str, gib: u64, id: impl ToString) -> (String, u64, String) {
    (name.to_owned(), gib * 1024, id.to_string())
}

/// `n` GPUs named `name` with `gib` GiB each, ids 0 to n-1.
fn alike(n: usize, name: &str, gib: u64) -> Vec<(String, u64, String)> {
    (0..n).map(|i| s(name, gib, i)).collect()
}

#[test]
fn tenstorrent_upstream_fixtures() {
    // upstream: runner/internal/shim/host/gpu_test.go (TestGetGpusFromTtSmiSnapshot*), on
    // the fixtures of runner/internal/shim/host/testdata/tenstorrent.
    let blackhole_boards = vec![
        s("p100a", 28, 0),
        s("p150", 32, 1),
        s("p150", 32, 2),
        s("p300", 32, 3),
        s("p300", 32, 4),
    ];
    for (file, want) in [
        ("single_n150_gpu.json", alike(1, "n150", 12)),
        ("valid_multiple_devices.json", alike(4, "n300", 24)),
        ("galaxy.json", alike(32, "tt-galaxy-wh", 12)),
        ("blackhole_galaxy.json", alike(32, "tt-galaxy-bh", 32)),
        ("blackhole_boards.json", blackhole_boards),
        ("blackhole_8xp150.json", alike(8, "p150", 32)),
        ("empty_device_info.json", vec![]),
        ("missing_device_info.json", vec![]),
        ("empty_json.json", vec![]),
    ] {
        assert_eq!(summary(&tt(file)), want, "{file}");
    }
    assert!(parse_tt_smi(&fixture("tenstorrent/invalid_json.json")).is_err());
    assert!(parse_tt_smi(r#"{"device_info": "x"}"#).is_err());
}

#[test]
fn tenstorrent_upstream_synthetic_cases() {
    // upstream: gpu_test.go (…WormholePrefixMemoryCompatibility).
    let custom = tt_devices(&[
        ("n150-custom L", "100018000000001", ""),
        ("n300-custom L", "100014000000001", ""),
        ("n300-custom R", "100014000000001", ""),
        ("tt-galaxy-wh-custom L", "100035000000001", ""),
    ]);
    let (n150, n300) = (s("n150-custom", 12, 0), s("n300-custom", 24, 1));
    assert_eq!(custom, [n150, n300, s("tt-galaxy-wh-custom", 12, 2)]);
    // (…BlackholeRevisions): three boards each read as p100a, p150 and p300.
    let revisions = tt_devices(&[
        ("bh-scrappy", "0000360000000000", ""),
        ("p100", "0000430000000000", ""),
        ("p100a", "0000430000000000", ""),
        ("p150a", "0000400000000000", ""),
        ("p150b", "0000410000000000", ""),
        ("p150c", "0000420000000000", ""),
        ("p300b", "0000440000000000", ""),
        ("p300a", "0000450000000000", ""),
        ("p300c", "0000460000000000", ""),
    ]);
    let names: Vec<_> = revisions
        .iter()
        .map(|g| (g.0.as_str(), g.1 / 1024))
        .collect();
    let want = [[("p100a", 28); 3], [("p150", 32); 3], [("p300", 32); 3]];
    assert_eq!(names, want.concat());
    let (p300, on_bus_1) = ("0000450000000000", "0000:01:00.0");
    // (…BlackholeP300SameBoardID): two local chips of one board are two GPUs.
    let same_board = tt_devices(&[("p300a", p300, on_bus_1), ("p300a", p300, "0000:02:00.0")]);
    assert_eq!(same_board, alike(2, "p300", 32));
    // (…BlackholeP300RemoteChip): a remote chip adds its memory to the local one.
    let remote = tt_devices(&[("p300a", p300, on_bus_1), ("p300a", p300, "N/A")]);
    assert_eq!(remote, [s("p300", 64, 0)]);
    // L chips come first, then chips without a side; a Wormhole chip without a side joins a
    // GPU of its board.
    let sides = tt_devices(&[
        ("n150", "B1", "0000:02:00.0"),
        ("n300 L", "B2", "0000:03:00.0"),
        ("n300", "B2", "N/A"),
    ]);
    assert_eq!(sides, [s("n300", 24, 0), s("n150", 12, 1)]);
    // Our own captured mixed host: n150, p150a, p150b.
    let mixed = parse_tt_smi(&fixture("tt-smi-mixed.json")).unwrap();
    let want = [s("n150", 12, 0), s("p150", 32, 1), s("p150", 32, 2)];
    assert_eq!(summary(&mixed), want);
}

#[tokio::test]
async fn intel_from_hl_smi() {
    let h = FakeHost::with_dev("accel");
    h.answer("hl-smi", "hl-smi.csv");
    let gpus = h.detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Intel));
    // upstream: runner/internal/shim/host/gpu.go (getIntelGpuInfo): three fields, no driver.
    h.assert_call(
        0,
        "hl-smi --query-aip=name,memory.total,index --format=csv,noheader,nounits",
    );
    assert_eq!(gpus.driver_version, None);
    assert_eq!(summary(&gpus.gpus), alike(3, "HL-225", 96));
    assert!(parse_hl_smi("HL-205, 32768, x\n").is_err());
    assert!(parse_hl_smi("HL-205, 32768, 0, 1.19\n").is_err());
}

/// No GPU ids.
const NONE: &[String] = &[];

#[test]
fn lock_acquire_counts() {
    let host = HostGpus::fake_nvidia(4);
    let lock = GpuLock::for_host(&host);
    assert_eq!(lock.acquire(0).unwrap(), NONE);
    let a = lock.acquire(3).unwrap();
    assert_eq!(a, host.ids()[..3]);
    // Not enough: error, nothing locked.
    let e = lock.acquire(2).unwrap_err();
    let ResourcesError::NotEnoughGpus {
        requested: 2,
        free: 1,
        total: 4,
        unhealthy,
    } = &e
    else {
        panic!("{e}");
    };
    assert!(unhealthy.is_empty(), "{e}");
    // Upstream's words (runner/internal/shim/resources.go, `ErrNoCapacity`).
    assert_eq!(e.to_string(), "no capacity: 2 GPUs requested, 1 available");
    assert_eq!(lock.free_count(), 1);
    // -1: all free ones.
    let b = lock.acquire(-1).unwrap();
    assert_eq!(b, host.ids()[3..]);
    assert_eq!(lock.acquire(-1).unwrap(), NONE);
    assert!(matches!(
        lock.acquire(-2),
        Err(ResourcesError::InvalidGpuCount { .. })
    ));
    lock.release(&a);
    lock.release(&a); // idempotent
    assert_eq!(lock.free_count(), 3);
    assert_eq!(lock.acquire(3).unwrap(), a);
}

/// Issue 36: a lock placed by the interconnect of a recorded 4-GPU box with NVLink bridges in
/// pairs (`testdata/gpu/topo/a30-nvlink-pairs-4gpu.txt`, from vllm-project/vllm#29070): two
/// GPUs are a bridged pair; with GPU0 taken, the next two are the other pair, not GPU1 and
/// GPU2 as first-free would give; one more GPU is then GPU1, the last free (never refused).
#[test]
fn the_lock_places_by_interconnect() {
    let host = HostGpus::fake_nvidia(4);
    let ids = host.ids();
    let lock = GpuLock::for_host(&host);
    let matrix = fixture("topo/a30-nvlink-pairs-4gpu.txt");
    lock.set_topology(Some(parse_nvidia_topo(&matrix).unwrap()));
    assert_eq!(lock.lock(&ids[..1]), ids[..1]);
    let msg = "the bridged pair, not first-free's GPU1+GPU2";
    assert_eq!(lock.acquire(2).unwrap(), ids[2..4], "{msg}");
    assert_eq!(lock.acquire(1).unwrap(), ids[1..2]);
    lock.release(&ids);
    let first = lock.acquire(2).unwrap();
    assert_eq!(first, ids[..2], "a bridged pair, the first of the two");
}

/// Issue 36: a GPU marked unhealthy is not handed to a new task: the healthy ones are, and a
/// request only the unhealthy one could meet gets upstream's error naming it and why; the
/// task holding it keeps it; once healthy again it is handed out.
#[test]
fn unhealthy_gpus_are_kept_out_of_new_tasks() {
    let host = HostGpus::fake_nvidia(3);
    let ids = host.ids();
    let lock = GpuLock::for_host(&host);
    let held = lock.acquire(1).unwrap();
    assert_eq!(held, ids[..1]);
    let bad = |id: &str, why: &str| (id.to_owned(), vec![why.to_owned()]);
    lock.set_unhealthy(
        [
            bad(&ids[0], "XID 79 (GPU has fallen off the bus)"),
            bad(&ids[1], "retired pages pending"),
            bad("GPU-not-here", "x"),
        ]
        .into(),
    );
    assert_eq!(lock.unhealthy().len(), 2, "an unknown id is ignored");
    assert_eq!(lock.locked(), held, "the task holding a bad GPU keeps it");
    let e = lock.acquire(2).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "no capacity: 2 GPUs requested, 1 available (1 kept out as unhealthy: {} \
             (retired pages pending))",
            ids[1]
        )
    );
    let all_free = lock.acquire(-1).unwrap();
    assert_eq!(all_free, ids[2..], "all the healthy free ones");
    lock.release(&ids[2..]);
    lock.set_unhealthy(Default::default());
    assert_eq!(lock.acquire(2).unwrap(), ids[1..]);
}

#[test]
fn lock_on_host_without_gpus() {
    let lock = GpuLock::for_host(&HostGpus::none());
    assert_eq!(lock.acquire(-1).unwrap(), NONE);
    assert_eq!(lock.acquire(0).unwrap(), NONE);
    assert!(lock.acquire(1).is_err());
    assert!(HostGpus::fake_nvidia(0).gpus.is_empty());
}

#[test]
fn lock_given_ids_returns_only_newly_locked() {
    let host = HostGpus::fake_nvidia(3);
    let ids = host.ids();
    let lock = GpuLock::for_host(&host);
    let first = lock.lock(&ids[..2]);
    assert_eq!(first, ids[..2]);
    // A duplicate restored task: nothing new, so releasing its result frees nothing.
    let dup = lock.lock(&ids[..2]);
    assert!(dup.is_empty());
    lock.release(&dup);
    assert_eq!(lock.locked().len(), 2);
    // Unknown ids are not locked.
    assert!(lock.lock(&["GPU-unknown".to_owned()]).is_empty());
    assert_eq!(lock.acquire(1).unwrap(), ids[2..]);
}

#[test]
fn lock_never_over_allocates_under_contention() {
    let lock = Arc::new(GpuLock::for_host(&HostGpus::fake_nvidia(8)));
    let threads: Vec<_> = (0..16)
        .map(|i| {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for round in 0..200 {
                    if let Ok(ids) = lock.acquire(1 + (i + round) % 3) {
                        held.push(ids);
                    }
                    if round % 3 == 0
                        && let Some(ids) = held.pop()
                    {
                        lock.release(&ids);
                    }
                }
                held.into_iter().flatten().collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<String> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "a GPU was handed out twice");
    assert_eq!(lock.locked(), all);
}
