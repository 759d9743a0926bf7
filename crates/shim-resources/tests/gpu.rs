//! GPU detection against a fake device root and recorded tool outputs; the lock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shim_resources::gpu::{parse_amd_smi, parse_hl_smi, parse_nvidia_smi, parse_tt_smi};
use shim_resources::{
    CommandOutput, Error, GpuDetector, GpuLock, GpuVendor, HostGpus, ScriptedCommandRunner,
};

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
        for d in ["dev", "sys", "bin"] {
            fs_err::create_dir(tmp.path().join(d)).unwrap();
        }
        Self {
            tmp,
            runner: Arc::new(ScriptedCommandRunner::new()),
        }
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

    fn tool_on_path(&self, name: &str) {
        fs_err::write(self.tmp.path().join("bin").join(name), "").unwrap();
    }

    fn detector(&self) -> GpuDetector {
        GpuDetector::new(self.runner.clone())
            .with_dev_root(self.dev())
            .with_sys_root(self.tmp.path().join("sys"))
            .with_path_env(self.tmp.path().join("bin"))
    }
}

#[test]
fn vendor_detection_order() {
    let h = FakeHost::new();
    assert_eq!(h.detector().detect_vendor(), None);
    h.touch_dev("accel");
    assert_eq!(h.detector().detect_vendor(), Some(GpuVendor::Intel));
    h.touch_dev("kfd");
    assert_eq!(h.detector().detect_vendor(), Some(GpuVendor::Amd));
    h.mkdir_dev("tenstorrent");
    assert_eq!(h.detector().detect_vendor(), Some(GpuVendor::Tenstorrent));
    // WSL: /dev/dxg alone is not NVIDIA; with nvidia-smi on the PATH it is.
    h.touch_dev("dxg");
    assert_eq!(h.detector().detect_vendor(), Some(GpuVendor::Tenstorrent));
    h.tool_on_path("nvidia-smi");
    assert_eq!(h.detector().detect_vendor(), Some(GpuVendor::Nvidia));
    let h2 = FakeHost::new();
    h2.touch_dev("kfd");
    h2.touch_dev("nvidiactl");
    assert_eq!(h2.detector().detect_vendor(), Some(GpuVendor::Nvidia));
}

#[tokio::test]
async fn nvidia_from_nvidia_smi() {
    let h = FakeHost::new();
    h.touch_dev("nvidiactl");
    h.runner
        .push("nvidia-smi", CommandOutput::ok(fixture("nvidia-smi.csv")));
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Nvidia));
    assert_eq!(gpus.driver_version.as_deref(), Some("570.86.15"));
    assert_eq!(gpus.gpus.len(), 2);
    assert_eq!(gpus.gpus[0].name, "NVIDIA H100 80GB HBM3");
    assert_eq!(gpus.gpus[0].memory_mib, 81559);
    assert_eq!(gpus.gpus[1].id, "GPU-7a1c9e02-5b3d-4a51-9c0e-1f2d3e4a5b6c");
    assert_eq!(gpus.gpus[1].index, 1);
    let call = &h.runner.calls()[0];
    assert_eq!(
        call[1..],
        [
            "--query-gpu=name,memory.total,uuid,driver_version",
            "--format=csv,noheader,nounits"
        ]
    );
}

#[tokio::test]
async fn failing_tool_yields_vendor_without_gpus() {
    let h = FakeHost::new();
    h.touch_dev("nvidiactl");
    h.runner.push(
        "nvidia-smi",
        CommandOutput::exit(9, "NVIDIA-SMI has failed"),
    );
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Nvidia));
    assert!(gpus.gpus.is_empty());
    assert!(gpus.driver_version.is_none());
}

#[test]
fn nvidia_parse_errors_and_placeholders() {
    assert!(parse_nvidia_smi("a, 1, GPU-x\n").is_err());
    let (gpus, driver) = parse_nvidia_smi("Tesla T4, [N/A], GPU-1, [Not Supported]\n").unwrap();
    assert_eq!(gpus[0].memory_mib, 0);
    assert_eq!(driver, None);
    assert!(parse_nvidia_smi("").unwrap().0.is_empty());
}

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

#[tokio::test]
async fn amd_rocm6_list_with_fallback_without_driver_option() {
    let h = FakeHost::new();
    h.touch_dev("kfd");
    h.tool_on_path("amd-smi");
    render_nodes(&h, &[("0000:5f:00.0", 128), ("0000:75:00.0", 136)]);
    // Old amd-smi rejects --driver, then answers without it.
    h.runner.push(
        "amd-smi",
        CommandOutput::exit(2, "unrecognized arguments: --driver"),
    );
    h.runner
        .push("amd-smi", CommandOutput::ok(fixture("amd-smi-rocm6.json")));
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Amd));
    assert_eq!(gpus.driver_version, None);
    let ids: Vec<_> = gpus.gpus.iter().map(|g| g.id.clone()).collect();
    let dri = fs_err::canonicalize(h.dev().join("dri")).unwrap();
    assert_eq!(
        ids,
        vec![
            dri.join("renderD128").to_string_lossy().into_owned(),
            dri.join("renderD136").to_string_lossy().into_owned()
        ]
    );
    assert_eq!(gpus.gpus[0].name, "AMD Instinct MI300X");
    assert_eq!(gpus.gpus[0].memory_mib, 196_592);
    let calls = h.runner.calls();
    assert!(calls[0].contains(&"--driver".to_owned()));
    assert!(!calls[1].contains(&"--driver".to_owned()));
}

#[tokio::test]
async fn amd_rocm7_object_via_docker_when_not_installed() {
    let h = FakeHost::new();
    h.touch_dev("kfd");
    render_nodes(&h, &[("0000:05:00.0", 128)]);
    h.runner
        .push("docker", CommandOutput::ok(fixture("amd-smi-rocm7.json")));
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.driver_version.as_deref(), Some("6.10.5"));
    assert_eq!(gpus.gpus.len(), 1);
    assert_eq!(gpus.gpus[0].name, "AMD Instinct MI325X");
    assert!(gpus.gpus[0].id.ends_with("/dri/renderD128"));
    let call = &h.runner.calls()[0];
    assert_eq!(call[0], "docker");
    assert!(call.contains(&shim_resources::gpu::AMD_SMI_IMAGE.to_owned()));
}

#[test]
fn amd_parse_shapes() {
    let (g6, d6) = parse_amd_smi(&fixture("amd-smi-rocm6.json")).unwrap();
    assert_eq!((g6.len(), d6), (2, None));
    assert_eq!(g6[1].bdf, "0000:75:00.0");
    let (g7, d7) = parse_amd_smi(&fixture("amd-smi-rocm7.json")).unwrap();
    assert_eq!((g7.len(), d7.as_deref()), (1, Some("6.10.5")));
    // driver_version key, other case.
    let (_, d) = parse_amd_smi(
        r#"[{"asic":{},"bus":{"bdf":"x"},"vram":{},"driver":{"Driver_Version":"6.8"}}]"#,
    )
    .unwrap();
    assert_eq!(d.as_deref(), Some("6.8"));
    assert!(parse_amd_smi(r#"{"other": 1}"#).is_err());
    assert!(parse_amd_smi("not json").is_err());
}

#[tokio::test]
async fn amd_gpu_without_render_node_is_skipped() {
    let h = FakeHost::new();
    h.touch_dev("kfd");
    h.tool_on_path("amd-smi");
    render_nodes(&h, &[("0000:5f:00.0", 128)]);
    h.runner
        .push("amd-smi", CommandOutput::ok(fixture("amd-smi-rocm6.json")));
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.gpus.len(), 1);
    assert_eq!(gpus.gpus[0].index, 0);
}

#[tokio::test]
async fn tenstorrent_n300_boards_combine_local_and_remote_chips() {
    let h = FakeHost::new();
    h.mkdir_dev("tenstorrent");
    h.tool_on_path("tt-smi");
    h.runner
        .push("tt-smi", CommandOutput::ok(fixture("tt-smi-n300x2.json")));
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Tenstorrent));
    assert_eq!(gpus.driver_version.as_deref(), Some("1.34"));
    assert_eq!(gpus.gpus.len(), 2);
    for (i, g) in gpus.gpus.iter().enumerate() {
        assert_eq!(g.name, "n300");
        assert_eq!(g.memory_mib, 24 * 1024, "L + R chips");
        assert_eq!(g.id, i.to_string());
    }
    // The driver version file wins over tt-smi's report.
    fs_err::create_dir_all(h.tmp.path().join("sys/module/tenstorrent")).unwrap();
    fs_err::write(
        h.tmp.path().join("sys/module/tenstorrent/version"),
        "2.0.0\n",
    )
    .unwrap();
    h.runner
        .push("tt-smi", CommandOutput::ok(fixture("tt-smi-n300x2.json")));
    assert_eq!(
        h.detector().detect().await.driver_version.as_deref(),
        Some("2.0.0")
    );
}

#[test]
fn tenstorrent_mixed_boards() {
    let (gpus, driver) = parse_tt_smi(&fixture("tt-smi-mixed.json")).unwrap();
    assert_eq!(driver, None, "N/A is unknown");
    let names: Vec<_> = gpus
        .iter()
        .map(|g| (g.name.as_str(), g.memory_mib))
        .collect();
    assert_eq!(
        names,
        vec![
            ("n150", 12 * 1024),
            ("p150", 32 * 1024),
            ("p150", 32 * 1024)
        ]
    );
    assert!(parse_tt_smi(r#"{"device_info": "x"}"#).is_err());
}

#[tokio::test]
async fn intel_from_hl_smi() {
    let h = FakeHost::new();
    h.touch_dev("accel");
    h.runner
        .push("hl-smi", CommandOutput::ok(fixture("hl-smi.csv")));
    let gpus = h.detector().detect().await;
    assert_eq!(gpus.vendor, Some(GpuVendor::Intel));
    assert_eq!(gpus.driver_version.as_deref(), Some("1.19.1-fw-53.1.1"));
    let ids: Vec<_> = gpus.gpus.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(ids, ["0", "1", "2"]);
    assert_eq!(gpus.gpus[2].memory_mib, 98304);
    // Three columns (no driver version) also parse.
    let (g, d) = parse_hl_smi("HL-205, 32768, 0\n").unwrap();
    assert_eq!((g.len(), d), (1, None));
    assert!(parse_hl_smi("HL-205, 32768, x\n").is_err());
}

#[test]
fn lock_acquire_counts() {
    let host = HostGpus::fake_nvidia(4);
    let lock = GpuLock::for_host(&host);
    assert_eq!(lock.acquire(0).unwrap(), Vec::<String>::new());
    let a = lock.acquire(3).unwrap();
    assert_eq!(a, host.ids()[..3]);
    // Not enough: error, nothing locked.
    let e = lock.acquire(2).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotEnoughGpus {
                requested: 2,
                free: 1,
                total: 4
            }
        ),
        "{e}"
    );
    assert_eq!(lock.free_count(), 1);
    // -1: all free ones.
    let b = lock.acquire(-1).unwrap();
    assert_eq!(b, host.ids()[3..]);
    assert_eq!(lock.acquire(-1).unwrap(), Vec::<String>::new());
    assert!(matches!(
        lock.acquire(-2),
        Err(Error::InvalidGpuCount { .. })
    ));
    lock.release(&a);
    lock.release(&a); // idempotent
    assert_eq!(lock.free_count(), 3);
    assert_eq!(lock.acquire(3).unwrap(), a);
}

#[test]
fn lock_on_host_without_gpus() {
    let lock = GpuLock::for_host(&HostGpus::none());
    assert_eq!(lock.acquire(-1).unwrap(), Vec::<String>::new());
    assert_eq!(lock.acquire(0).unwrap(), Vec::<String>::new());
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
                    if round % 3 == 0 {
                        if let Some(ids) = held.pop() {
                            lock.release(&ids);
                        }
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
