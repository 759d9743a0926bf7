//! `DcgmHealth` and `Dcgm` against fake `dcgmi`, `nv-hostengine` and `dcgm-exporter`
//! programs: real executable shell scripts, run the way the real ones would be.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{alive, lines, script, testdata, wait_until};
use shim_dcgm::{Dcgm, DcgmConfig, DcgmErrorKind, DcgmHealth, HEALTH_FAIL, HEALTH_PASS};
use shim_util::SystemCommandRunner;

/// A fake `dcgmi health`: logs each call's arguments to `calls`; `-s a` creates `enabled`;
/// `-c -j` prints `report.json` if `enabled` exists (else dcgmi's "not enabled" error), or
/// dcgmi's connection error if `down` exists; hangs while `hung` exists.
fn fake_dcgmi(dir: &Path, report: &str) -> PathBuf {
    fs_err::write(dir.join("report.json"), testdata(report)).unwrap();
    let body = r#"echo "$*" >> $D/calls
while [ -f $D/hung ]; do sleep 0.1; done
if [ -f $D/down ]; then
  echo "Error: unable to establish a connection to the specified host: localhost"
  echo "Error: Unable to connect to host engine. Host engine connection invalid/disconnected."
  exit 255
fi
case "$*" in
  *" -s a") touch $D/enabled; echo "Health monitor systems set successfully.";;
  *" -c -j")
    if [ ! -f $D/enabled ]; then echo "Error: Health watches not enabled. Please enable watches. "; exit 1; fi
    cat $D/report.json;;
  *) echo "unexpected arguments: $*" >&2; exit 2;;
esac"#;
    script(dir, "dcgmi", body)
}

/// The calls `fake_dcgmi` logged in `dir`, one `;` after each.
fn calls(dir: &Path) -> String {
    lines(&dir.join("calls"))
        .iter()
        .map(|l| format!("{l}; "))
        .collect()
}

/// How long a test waits for a program to run.
const WAIT: Duration = Duration::from_secs(10);

fn health(dcgmi: PathBuf, host: Option<&str>) -> DcgmHealth {
    DcgmHealth::with_runner(
        Arc::new(SystemCommandRunner::default()),
        dcgmi,
        host.map(str::to_owned),
        Duration::from_secs(10),
    )
}

// upstream: runner/internal/shim/dcgm/wrapper_cgo.go (EnableHealthChecks: HealthSet(all GPUs,
// WATCH_ALL) + one initial HealthCheck; GetHealth: HealthCheck), wrapper_cgo_test.go (healthy:
// overall 0, no incidents), runner/internal/shim/api/handlers.go (InstanceHealthHandler)
#[tokio::test]
async fn a_healthy_host_through_dcgmi() {
    let dir = tempfile::tempdir().unwrap();
    let h = health(fake_dcgmi(dir.path(), "dcgmi-health-healthy.json"), None);
    let report = h.check().await.unwrap();
    assert_eq!(report.overall_health, HEALTH_PASS);
    assert!(report.incidents.is_empty());
    let json = serde_json::to_string(&h.instance_health().await).unwrap();
    assert_eq!(json, r#"{"dcgm":{"overall_health":0,"incidents":[]}}"#);
    let expected = "health -s a; health -c -j; health -c -j; health -c -j; ";
    assert_eq!(calls(dir.path()), expected);
}

/// A check late by its budget (a host engine that hangs with a wedged GPU, each dcgmi run
/// killed only after its own 10 s) answers with the last health read, within the budget: the
/// dstack server gives the request 9 s, and counts an instance it cannot read unreachable.
#[tokio::test]
async fn a_late_check_answers_with_the_last_health_read() {
    let dir = tempfile::tempdir().unwrap();
    let h = health(fake_dcgmi(dir.path(), "dcgmi-health-incidents.json"), None);
    let budget = Duration::from_secs(1);
    let read = h.instance_health().await;
    assert_eq!(read.dcgm.as_ref().unwrap().overall_health, HEALTH_FAIL);
    fs_err::write(dir.path().join("hung"), "").unwrap();
    let asked = std::time::Instant::now();
    assert_eq!(h.instance_health_within(budget).await, read);
    assert!(asked.elapsed() < budget * 3, "{:?}", asked.elapsed());
    fs_err::remove_file(dir.path().join("hung")).unwrap();
}

// upstream: runner/internal/shim/dcgm/wrapper_cgo_test.go (injected DBE + PCIe replays:
// overall 20, incidents 0x1 warn and 0x10 fail on entity group 1, the GPU's id)
#[tokio::test]
async fn incidents_through_dcgmi() {
    let dir = tempfile::tempdir().unwrap();
    let h = health(fake_dcgmi(dir.path(), "dcgmi-health-incidents.json"), None);
    let json = serde_json::to_value(h.instance_health().await).unwrap();
    assert_eq!(json["dcgm"]["overall_health"], HEALTH_FAIL);
    let incidents = json["dcgm"]["incidents"].as_array().unwrap();
    assert_eq!(incidents.len(), 3);
    // (system, health, entity group, entity) and a part of the message.
    for (i, want, message) in [
        (0, [0x1, 10, 1, 0], "PCIe replay"),
        (1, [0x10, 20, 1, 0], "volatile double-bit ECC error"),
    ] {
        let got = ["system", "health", "entity_group_id", "entity_id"].map(|k| &incidents[i][k]);
        assert_eq!(got, want, "incident {i}");
        let text = incidents[i]["error_message"].as_str().unwrap();
        assert!(text.contains(message), "incident {i}: {text}");
    }
    assert_eq!(incidents[2]["entity_id"], 1);
}

#[tokio::test]
async fn watches_lost_with_the_host_engine_are_enabled_again() {
    let dir = tempfile::tempdir().unwrap();
    let h = health(fake_dcgmi(dir.path(), "dcgmi-health-healthy.json"), None);
    h.enable().await.unwrap();
    // The host engine restarted: its watches are gone.
    fs_err::remove_file(dir.path().join("enabled")).unwrap();
    assert_eq!(h.check().await.unwrap().overall_health, HEALTH_PASS);
    let expected =
        "health -s a; health -c -j; health -c -j; health -s a; health -c -j; health -c -j; ";
    assert_eq!(calls(dir.path()), expected);
}

// upstream: runner/internal/shim/api/handlers.go (InstanceHealthHandler: a GetHealth error is
// logged and the DCGM part left out)
#[tokio::test]
async fn a_failing_dcgmi_leaves_health_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let dcgmi = fake_dcgmi(dir.path(), "dcgmi-health-healthy.json");
    let h = health(dcgmi, Some("10.0.0.9"));
    fs_err::write(dir.path().join("down"), "").unwrap();
    let err = h.check().await.unwrap_err();
    assert_eq!(err.kind(), DcgmErrorKind::Upstream);
    let text = err.to_string();
    assert!(text.contains("unable to establish a connection"), "{text}");
    assert!(text.contains("health --host 10.0.0.9 -s a"), "{text}");
    let json = serde_json::to_string(&h.instance_health().await).unwrap();
    assert_eq!(json, r#"{"dcgm":null}"#);

    // Garbage on stdout with exit 0 is an error too.
    fs_err::remove_file(dir.path().join("down")).unwrap();
    fs_err::write(dir.path().join("report.json"), "Health Monitor Report\n").unwrap();
    let err = h.check().await.unwrap_err();
    assert_eq!(err.kind(), DcgmErrorKind::Upstream);
    assert!(err.to_string().contains("unexpected report"), "{err}");
}

fn no_programs(dir: &Path) -> DcgmConfig {
    let none = dir.join("none");
    DcgmConfig {
        exporter_path: Some(none.join("dcgm-exporter")),
        dcgmi_path: Some(none.join("dcgmi")),
        hostengine_path: Some(none.join("nv-hostengine")),
        ..DcgmConfig::default()
    }
}

// upstream: runner/cmd/shim/main.go (exporter and libdcgm only on NVIDIA hosts, each only when
// usable), runner/internal/shim/api/handlers.go (no exporter → 404; no DCGM → no health)
#[tokio::test]
async fn nothing_runs_off_nvidia_or_without_programs() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = no_programs(dir.path());
    let dcgm = Dcgm::start(&config, true).await;
    assert!(dcgm.exporter.is_none() && dcgm.health.is_none());

    // Present programs on a host that is not NVIDIA: still nothing, nothing run.
    config.dcgmi_path = Some(fake_dcgmi(dir.path(), "dcgmi-health-healthy.json"));
    let body = "echo ran >> $D/exporter-ran; exec sleep 600";
    config.exporter_path = Some(script(dir.path(), "dcgm-exporter", body));
    let dcgm = Dcgm::start(&config, false).await;
    assert!(dcgm.exporter.is_none() && dcgm.health.is_none());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!dir.path().join("calls").exists());
    assert!(!dir.path().join("exporter-ran").exists());
}

// The counterpart of upstream's embedded host engine (wrapper_cgo.go NewDCGMWrapper with an
// empty address), and upstream's standalone mode (`--dcgm-address`).
#[tokio::test]
async fn a_private_host_engine_unless_an_address_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let body = "printf '%s\\n' \"$@\" >> $D/hostengine-args\nexec sleep 600";
    let hostengine = script(dir.path(), "nv-hostengine", body);
    let logs = tempfile::tempdir().unwrap();
    let config = DcgmConfig {
        dcgmi_path: Some(fake_dcgmi(dir.path(), "dcgmi-health-healthy.json")),
        hostengine_path: Some(hostengine),
        log_dir: Some(logs.path().to_path_buf()),
        ..no_programs(dir.path())
    };
    let dcgm = Dcgm::start(&config, true).await;
    assert!(dcgm.exporter.is_none());
    let health = dcgm.health.as_ref().expect("dcgmi is there");
    let host = health.host().expect("the private host engine").to_owned();
    let socket = host.strip_prefix("unix://").expect("a unix socket");
    assert!(socket.ends_with("/nv-hostengine.sock"), "{socket}");

    let args_file = dir.path().join("hostengine-args");
    let all_args = || lines(&args_file).len() == 7;
    wait_until("nv-hostengine's arguments", WAIT, all_args).await;
    let socket_dir = Path::new(&socket).parent().unwrap();
    let (run, log) = (socket_dir.display(), logs.path().display());
    let args = format!("-n -d {socket} --pid {run}/nv-hostengine.pid -f {log}/nv-hostengine.log");
    assert_eq!(lines(&args_file), args.split(' ').collect::<Vec<_>>());
    // The watches are enabled at start-up, through that host engine.
    let calls = dir.path().join("calls");
    wait_until("enabling at start-up", WAIT, || lines(&calls).len() >= 2).await;
    let enabling = format!("health --host {host} -s a;health --host {host} -c -j");
    assert_eq!(lines(&calls)[..2], enabling.split(';').collect::<Vec<_>>());
    assert_eq!(health.check().await.unwrap().overall_health, HEALTH_PASS);

    let pid = health.hostengine_pid().expect("nv-hostengine runs");
    assert!(alive(pid));
    let shared = Arc::new(dcgm); // as the API holds it
    shared.shutdown().await;
    assert!(!alive(pid), "nv-hostengine still runs");
    assert!(!socket_dir.exists(), "the socket directory is left behind");
    shared.shutdown().await; // a second call does nothing

    // With an address: dcgmi asks it, no host engine of ours.
    fs_err::remove_file(&args_file).unwrap();
    let config = DcgmConfig {
        address: Some("10.1.2.3".into()),
        ..config
    };
    let dcgm = Dcgm::start(&config, true).await;
    let health = dcgm.health.as_ref().unwrap();
    assert_eq!(health.host(), Some("10.1.2.3"));
    assert_eq!(health.hostengine_pid(), None);
    assert_eq!(health.check().await.unwrap().overall_health, HEALTH_PASS);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!args_file.exists(), "nv-hostengine was started");
    dcgm.shutdown().await;

    // No address and no nv-hostengine: dcgmi's default host.
    let config = DcgmConfig {
        address: None,
        hostengine_path: Some(dir.path().join("none/nv-hostengine")),
        ..config
    };
    let dcgm = Dcgm::start(&config, true).await;
    assert_eq!(dcgm.health.as_ref().unwrap().host(), None);
    dcgm.shutdown().await;
}
