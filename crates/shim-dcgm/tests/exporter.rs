//! `DcgmExporter` against fake exporters: real shell scripts started, restarted and stopped as
//! the real binary would be, and a real HTTP server serving a recorded dcgm-exporter payload.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{FakeExporter, Reply, alive, closed_port, lines, script, testdata, wait_until};
use shim_dcgm::{
    Backoff, COUNTERS, DcgmConfig, DcgmError, DcgmErrorKind, DcgmExporter, counters_csv,
};

const PAYLOAD: &str = "dcgm-exporter-8xA800-mig.prom";
const GPU0: &str = "GPU-1f027ee8-6e1e-2b8c-0108-3d370e5f0418"; // MIG: 3 samples per family
const GPU1: &str = "GPU-9e5b8fec-61bf-5124-a0a9-079af1b65cc6";
const GPU7: &str = "GPU-4e75c9ab-0ed7-8a57-75f5-23761b9f053f";

/// How long a test waits for a process to start or stop.
const WAIT: Duration = Duration::from_secs(10);

fn config(port: u16, exporter: &Path) -> DcgmConfig {
    DcgmConfig {
        exporter_http_port: port,
        exporter_path: Some(exporter.to_path_buf()),
        stop_grace: Duration::from_secs(2),
        backoff: Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(100),
            reset_after: Duration::from_secs(60),
        },
        ..DcgmConfig::default()
    }
}

/// `program` supervised, answering on `port`, with the test configuration.
fn spawn(program: &Path, port: u16) -> DcgmExporter {
    DcgmExporter::spawn(program, &config(port, program)).unwrap()
}

/// Waits for the exporter's process to start; its pid.
async fn started(exporter: &DcgmExporter) -> u32 {
    wait_until("the start", WAIT, || exporter.pid().is_some()).await;
    exporter.pid().unwrap()
}

/// The metrics of the task holding `gpus`.
async fn task_metrics(exporter: &DcgmExporter, gpus: &[&str]) -> Result<String, DcgmError> {
    let ids: Vec<String> = gpus.iter().map(|s| (*s).to_owned()).collect();
    exporter.fetch_task_metrics(&ids).await
}

/// A fake `dcgm-exporter`: answers `-v` like the real one; otherwise records its arguments and
/// a copy of its collectors file (`-f`), then sleeps until killed.
fn fake_exporter(dir: &Path) -> PathBuf {
    let body = r#"if [ "$1" = "-v" ]; then echo "DCGM Exporter version 4.1.1-4.0.4"; exit 0; fi
printf '%s\n' "$@" >> $D/args
cp "$2" $D/counters.tmp && mv $D/counters.tmp $D/counters.csv
echo "listening on $4" >&2
exec sleep 600"#;
    script(dir, "dcgm-exporter", body)
}

// upstream: runner/internal/shim/dcgm/exporter.go (Start: `-f <counters.csv> -a
// localhost:<port> -c <interval ms>`; GetDCGMExporterExecPath: `-v` must exit 0; Stop: remove
// the counters file), runner/internal/shim/api/handlers.go (TaskMetricsHandler: fetch, then
// FilterMetrics by the task's GPU ids)
#[tokio::test]
async fn serves_each_tasks_gpus_from_a_supervised_exporter() {
    let dir = tempfile::tempdir().unwrap();
    let payload = testdata(PAYLOAD);
    let server = FakeExporter::start(Reply::Answer(200, payload.clone())).await;
    let program = fake_exporter(dir.path());
    let exporter = DcgmExporter::start(&config(server.port, &program))
        .await
        .expect("the exporter starts");
    let port = server.port;
    assert_eq!(exporter.url(), format!("http://localhost:{port}/metrics"));

    let args_file = dir.path().join("args");
    wait_until("the exporter's arguments", WAIT, || {
        lines(&args_file).len() == 6 && dir.path().join("counters.csv").exists()
    })
    .await;
    let counters = exporter.counters_path().to_path_buf();
    let listen = format!("localhost:{port}");
    let counters_arg = counters.to_str().unwrap();
    let args = ["-f", counters_arg, "-a", &listen, "-c", "5000"];
    assert_eq!(lines(&args_file), args);
    let name = counters.file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("dstack-dcgm-counters-"), "{name}");
    let collectors = fs_err::read_to_string(dir.path().join("counters.csv")).unwrap();
    assert_eq!(collectors, counters_csv(COUNTERS));
    let pid = exporter.pid().expect("running");
    assert!(alive(pid));

    // One GPU: the HELP, TYPE and sample of each of the nine families.
    let got = task_metrics(&exporter, &[GPU1]).await.unwrap();
    let want: String = payload
        .lines()
        .filter(|l| l.starts_with('#') || l.contains(GPU1))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(got, want);
    assert_eq!(got.lines().count(), 9 * 3);
    assert!(!got.contains(GPU7) && !got.contains(GPU0));

    // The MIG GPU: three samples per family, and no GPU_UTIL/MEM_COPY_UTIL families at all
    // (it has no samples there).
    let got = task_metrics(&exporter, &[GPU0]).await.unwrap();
    assert_eq!(got.lines().count(), 7 * (2 + 3));
    assert!(!got.contains("DCGM_FI_DEV_GPU_UTIL"), "{got}");
    assert!(!got.contains("DCGM_FI_DEV_MEM_COPY_UTIL"), "{got}");
    assert_eq!(got.matches("GPU_I_ID=").count(), 7 * 3);

    // Two GPUs of eight.
    let got = task_metrics(&exporter, &[GPU7, GPU1]).await.unwrap();
    assert_eq!(got.lines().count(), 9 * 4);
    assert_eq!(got.matches(GPU1).count(), 9);
    assert_eq!(got.matches(GPU7).count(), 9);

    // No GPUs (upstream: runner/internal/shim/dcgm/metrics.go, FilterMetrics: no ids, nothing
    // kept), or GPUs the exporter does not know: an empty body.
    assert_eq!(task_metrics(&exporter, &[]).await.unwrap(), "");
    let unknown = "GPU-00000000-0000-0000-0000-000000000000";
    assert_eq!(task_metrics(&exporter, &[unknown]).await.unwrap(), "");
    // All of that came from one request: answers are reused for the collect interval.
    assert_eq!(server.requests(), 1);

    exporter.shutdown().await;
    assert!(!alive(pid), "the exporter still runs");
    assert!(!counters.exists(), "the counters file is left behind");
}

// upstream: runner/internal/shim/dcgm/exporter.go (Fetch: the last answer is reused while it
// is younger than the collect interval; errors are not cached)
#[tokio::test]
async fn answers_are_reused_for_the_collect_interval_only() {
    let dir = tempfile::tempdir().unwrap();
    let server = FakeExporter::start(Reply::Answer(200, testdata(PAYLOAD))).await;
    let program = fake_exporter(dir.path());

    let mut cfg = config(server.port, &program);
    cfg.exporter_interval = Duration::from_millis(200);
    let exporter = DcgmExporter::spawn(&program, &cfg).unwrap();
    exporter.fetch().await.unwrap();
    exporter.fetch().await.unwrap();
    assert_eq!(server.requests(), 1);
    tokio::time::sleep(Duration::from_millis(250)).await;
    exporter.fetch().await.unwrap();
    assert_eq!(server.requests(), 2);
    exporter.shutdown().await;

    cfg.exporter_interval = Duration::ZERO;
    let exporter = DcgmExporter::spawn(&program, &cfg).unwrap();
    exporter.fetch().await.unwrap();
    exporter.fetch().await.unwrap();
    assert_eq!(server.requests(), 4);
    exporter.shutdown().await;
}

// upstream: runner/internal/shim/api/handlers.go (TaskMetricsHandler: any Fetch error → 502),
// runner/internal/shim/dcgm/exporter.go (Fetch: `status is not OK: %d`; client timeout 10 s)
#[tokio::test]
async fn exporter_failures_are_upstream_errors() {
    let dir = tempfile::tempdir().unwrap();
    let program = fake_exporter(dir.path());

    let server = FakeExporter::start(Reply::Answer(500, "oops".into())).await;
    let exporter = spawn(&program, server.port);
    let err = task_metrics(&exporter, &[GPU1]).await.unwrap_err();
    let status = matches!(err, DcgmError::Status { status: 500, .. });
    assert!(status, "{err}");
    assert_eq!(err.kind(), DcgmErrorKind::Upstream);
    assert!(err.to_string().contains("status is not OK: 500"), "{err}");
    // Failures are not cached: the next call asks again.
    task_metrics(&exporter, &[GPU1]).await.unwrap_err();
    assert_eq!(server.requests(), 2);
    exporter.shutdown().await;

    let port = closed_port().await;
    let exporter = spawn(&program, port);
    let err = task_metrics(&exporter, &[GPU1]).await.unwrap_err();
    assert!(matches!(err, DcgmError::Fetch { .. }), "{err}");
    assert_eq!(err.kind(), DcgmErrorKind::Upstream);
    let url = format!("localhost:{port}");
    assert!(err.to_string().contains(&url), "{err}");
    exporter.shutdown().await;

    let server = FakeExporter::start(Reply::Hang).await;
    let mut cfg = config(server.port, &program);
    cfg.fetch_timeout = Duration::from_millis(200);
    let exporter = DcgmExporter::spawn(&program, &cfg).unwrap();
    let fetching = Instant::now();
    let err = exporter.fetch().await.unwrap_err();
    assert!(matches!(err, DcgmError::FetchTimeout { .. }), "{err}");
    assert_eq!(err.kind(), DcgmErrorKind::Upstream);
    assert!(fetching.elapsed() < Duration::from_secs(5));
    exporter.shutdown().await;
}

#[tokio::test]
async fn an_exporter_that_exits_is_restarted_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let body = "date +%s.%N >> $D/starts\necho 'Failed to initialize NVML' >&2\nexit 1";
    let program = script(dir.path(), "dcgm-exporter", body);
    let exporter = spawn(&program, closed_port().await);
    let starts = dir.path().join("starts");
    wait_until("four starts", WAIT, || lines(&starts).len() >= 4).await;
    assert!(exporter.starts() >= 4, "{}", exporter.starts());
    // Delays 20, 40, 80 ms: the fourth start is at least 140 ms after the first.
    let times: Vec<f64> = lines(&starts).iter().map(|l| l.parse().unwrap()).collect();
    assert!(times[3] - times[0] >= 0.13, "{times:?}");
    exporter.shutdown().await;
    let after = lines(&starts).len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(lines(&starts).len(), after, "restarted after shutdown");
}

// upstream: runner/internal/shim/dcgm/exporter.go (Stop: SIGTERM, then SIGKILL after
// WaitDelay = 5 s)
#[tokio::test]
async fn shutdown_sends_sigterm_then_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    // Ignores SIGTERM (records it) and keeps running.
    let body =
        "trap 'echo TERM >> $D/signals' TERM\n: > $D/trapped\nwhile true; do sleep 0.05; done";
    let stubborn = script(dir.path(), "stubborn", body);
    let mut cfg = config(closed_port().await, &stubborn);
    cfg.stop_grace = Duration::from_millis(300);
    let exporter = DcgmExporter::spawn(&stubborn, &cfg).unwrap();
    let pid = started(&exporter).await;
    let trapped = dir.path().join("trapped");
    wait_until("the trap", WAIT, || trapped.exists()).await;
    let stopping = Instant::now();
    exporter.shutdown().await;
    assert!(stopping.elapsed() >= Duration::from_millis(300));
    assert!(!alive(pid));
    assert_eq!(lines(&dir.path().join("signals")), ["TERM"]);

    // One that exits on SIGTERM stops at once.
    let polite = script(dir.path(), "polite", "exec sleep 600");
    cfg.stop_grace = Duration::from_secs(10);
    let exporter = DcgmExporter::spawn(&polite, &cfg).unwrap();
    let pid = started(&exporter).await;
    let stopping = Instant::now();
    exporter.shutdown().await;
    assert!(stopping.elapsed() < Duration::from_secs(5));
    assert!(!alive(pid));
}

#[tokio::test]
async fn dropping_the_exporter_kills_it() {
    let dir = tempfile::tempdir().unwrap();
    let program = script(dir.path(), "dcgm-exporter", "exec sleep 600");
    let exporter = spawn(&program, closed_port().await);
    let pid = started(&exporter).await;
    let counters = exporter.counters_path().to_path_buf();
    drop(exporter);
    wait_until("the kill", WAIT, || !alive(pid)).await;
    assert!(!counters.exists());
}

// upstream: runner/cmd/shim/main.go and runner/internal/shim/dcgm/exporter.go
// (GetDCGMExporterExecPath: not found or `-v` failing → no exporter → handlers.go answers 404)
#[tokio::test]
async fn a_missing_or_broken_exporter_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let body = "echo ran >> $D/ran\n\
        echo 'libdcgm.so.4: cannot open shared object file' >&2\nexit 1";
    let broken = script(dir.path(), "dcgm-exporter", body);
    let missing = dir.path().join("nowhere/dcgm-exporter");
    for program in [&broken, &missing] {
        let exporter = DcgmExporter::start(&config(closed_port().await, program)).await;
        assert!(exporter.is_none(), "{}", program.display());
    }
    assert_eq!(lines(&dir.path().join("ran")), ["ran"], "only `-v` ran");
}

/// Field 22 of `/proc/<pid>/stat`: the start time in clock ticks since boot.
fn start_time(pid: u32) -> u64 {
    let stat = fs_err::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// What a pid file says of process `pid` in this boot.
fn pid_line(pid: u32) -> String {
    let boot = fs_err::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    format!("{pid} {} {}", start_time(pid), boot.trim())
}

/// A fake exporter in `dir`, its config with the state directory `dir/home`, and the pid file
/// there.
async fn with_home(dir: &Path) -> (PathBuf, DcgmConfig, PathBuf) {
    let home = dir.join("home");
    fs_err::create_dir(&home).unwrap();
    let program = fake_exporter(dir);
    let mut cfg = config(closed_port().await, &program);
    cfg.state_dir = Some(home.clone());
    (program, cfg, home.join("dcgm-exporter.pid"))
}

/// A shim killed without its shutdown (SIGKILL, a crash) leaves its exporter running, and the
/// exporter keeps the port the next shim's exporter needs. The pid file in the shim's home
/// lets the next shim stop it before starting its own; the pid file goes with a clean shutdown.
/// The collectors file lives in the home and is written again in place.
#[tokio::test]
async fn an_exporter_left_by_a_killed_shim_is_stopped_by_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let (program, cfg, pid_file) = with_home(dir.path()).await;
    // The killed shim: its runtime never runs again and is never dropped, so nothing stops,
    // waits on or restarts its exporter, as after a SIGKILL.
    let (killed, counters) = {
        let (program, cfg) = (program.clone(), cfg.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let left = rt.block_on(async {
                let exporter = DcgmExporter::spawn(&program, &cfg).unwrap();
                let pid = started(&exporter).await;
                let counters = exporter.counters_path().to_path_buf();
                std::mem::forget(exporter);
                (pid, counters)
            });
            std::mem::forget(rt);
            left
        })
        .join()
        .unwrap()
    };
    // With a state directory the collectors file is there, not in /tmp, where the system's
    // temp cleaner deletes what is untouched for days (every restart of the exporter reads it).
    let in_home = dir.path().join("home/dcgm-exporter-counters.csv");
    assert_eq!(counters, in_home);
    assert!(alive(killed));
    assert_eq!(lines(&pid_file), [pid_line(killed)]);

    let next = DcgmExporter::spawn(&program, &cfg).unwrap();
    let pid = started(&next).await;
    assert!(!alive(killed), "the killed shim's exporter still runs");
    assert_eq!(next.counters_path(), counters, "written again in place");
    let collectors = fs_err::read_to_string(&counters).unwrap();
    assert_eq!(collectors, counters_csv(COUNTERS));
    assert_ne!(pid, killed);
    assert_eq!(lines(&pid_file), [pid_line(pid)]);
    next.shutdown().await;
    assert!(!alive(pid));
    assert!(!pid_file.exists(), "a clean shutdown leaves no pid file");
}

/// A leftover that ignores SIGTERM is killed once the grace period is over, before the next
/// exporter starts.
#[tokio::test]
async fn a_leftover_that_ignores_sigterm_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let (program, mut cfg, pid_file) = with_home(dir.path()).await;
    cfg.stop_grace = Duration::from_millis(300);
    let trapped = dir.path().join("trapped");
    let body = format!(
        "trap '' TERM; : > '{}'; while true; do sleep 0.05; done",
        trapped.display()
    );
    let mut stubborn = std::process::Command::new("sh")
        .args(["-c", &body])
        .spawn()
        .unwrap();
    let pid = stubborn.id();
    wait_until("the trap", WAIT, || trapped.exists()).await;
    fs_err::write(&pid_file, pid_line(pid)).unwrap();
    let exporter = DcgmExporter::spawn(&program, &cfg).unwrap();
    started(&exporter).await;
    // The exporter starts only after the leftover is gone: it was killed by then.
    let Some(status) = stubborn.try_wait().unwrap() else {
        stubborn.kill().unwrap();
        stubborn.wait().unwrap();
        panic!("the leftover that ignores SIGTERM still runs");
    };
    let signal = std::os::unix::process::ExitStatusExt::signal(&status);
    assert_eq!(signal, Some(9), "{status:?}");
    exporter.shutdown().await;
}

/// An exporter stuck in the kernel (an NVML call into a wedged driver; here a write to a frozen
/// file system) does not die on SIGKILL until the call returns. The shutdown waits for it a
/// bounded while and goes on, its pid file kept for the next start; it used to wait for it
/// forever, and with it the shim's exit (an upgrade's watchdog then rolled back a binary that
/// never ran).
#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn a_shutdown_does_not_wait_for_an_exporter_stuck_in_the_kernel() {
    shim_util::testing::require_root();
    let dir = tempfile::tempdir().unwrap();
    let frozen = shim_util::testing::FrozenFs::new(dir.path());
    let (_, mut cfg, pid_file) = with_home(dir.path()).await;
    cfg.stop_grace = Duration::from_millis(300);
    let body = format!("echo x > '{}/f'", frozen.mount.display());
    let stuck = script(dir.path(), "stuck", &body);
    let exporter = DcgmExporter::spawn(&stuck, &cfg).unwrap();
    let pid = started(&exporter).await;
    let state = || {
        let stat = fs_err::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
    };
    wait_until("the write blocks", WAIT, || state() == Some('D')).await;
    let stopping = Instant::now();
    let shutdown = tokio::time::timeout(Duration::from_secs(30), exporter.shutdown()).await;
    assert!(shutdown.is_ok(), "the shutdown waited on");
    let took = stopping.elapsed();
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(alive(pid), "still stuck in the kernel");
    assert!(pid_file.exists(), "the pid file stays for the next start");
    drop(frozen);
    wait_until("the exporter dies once thawed", WAIT, || !alive(pid)).await;
}

/// A pid file never makes the shim signal a process that merely has the recorded pid: one
/// with another start time, or one of another boot (a reboot may give the pid and even the
/// start time to another process).
#[tokio::test]
async fn a_pid_file_naming_another_process_is_only_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (program, cfg, pid_file) = with_home(dir.path()).await;
    let mut other = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let other_pid = other.id();
    let line = pid_line(other_pid);
    let start = start_time(other_pid);
    for recorded in [
        // The right pid with another start time.
        line.replacen(&format!(" {start} "), &format!(" {} ", start + 1), 1),
        // The right pid and start time, of another boot.
        format!("{other_pid} {start} 00000000-0000-0000-0000-000000000000"),
        // Not a pid file at all.
        "garbage".to_owned(),
    ] {
        assert_ne!(recorded, line);
        fs_err::write(&pid_file, &recorded).unwrap();
        let exporter = DcgmExporter::spawn(&program, &cfg).unwrap();
        started(&exporter).await;
        assert!(alive(other_pid), "signalled after {recorded:?}");
        exporter.shutdown().await;
        assert!(!pid_file.exists());
    }
    other.kill().unwrap();
    other.wait().unwrap();
}
