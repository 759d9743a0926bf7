//! The built binary: `--version`, serving, logging, signals and API shutdown.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_dstack-shim");
const BOUND: Duration = Duration::from_secs(30);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Shim {
    child: Child,
    port: u16,
}

impl Drop for Shim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(home: &Path, extra: &[&str]) -> Shim {
    let port = free_port();
    let child = Command::new(BIN)
        .args(["--shim-home", home.to_str().unwrap()])
        .args(["--shim-http-port", &port.to_string()])
        .args([
            "--runner-binary-path",
            home.join("no-runner").to_str().unwrap(),
        ])
        .args(extra)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let shim = Shim { child, port };
    let deadline = Instant::now() + BOUND;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "the shim did not start listening"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    shim
}

fn exchange(
    mut s: impl Read + Write,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        ));
    } else {
        req.push_str("\r\n");
    }
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    exchange(s, method, path, body)
}

fn wait_exit(child: &mut Child) -> ExitStatus {
    let deadline = Instant::now() + BOUND;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the shim did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn prints_its_version() {
    for flag in ["--version", "-v"] {
        let out = Command::new(BIN).arg(flag).output().unwrap();
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            format!(
                "dstack-shim version 0.22.5+rust.{}\n",
                env!("CARGO_PKG_VERSION")
            )
        );
    }
}

#[test]
fn rejects_bad_flags() {
    let out = Command::new(BIN).arg("--no-such-flag").output().unwrap();
    assert!(!out.status.success());
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "--shim-home",
            home.path().to_str().unwrap(),
            "--shim-log-level",
            "loud",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid log level: loud"));
}

#[test]
fn serves_logs_and_stops_on_sigterm() {
    if !shim_e2e::docker_tests_enabled("serves_logs_and_stops_on_sigterm") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let mut shim = start(home.path(), &[]);

    let (status, body) = http(shim.port, "GET", "/api/healthcheck", None);
    assert_eq!(status, 200);
    // One version string everywhere (the healthcheck, `--version`, the components list).
    let version = format!("0.22.5+rust.{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(
        body,
        format!(r#"{{"service":"dstack-shim","version":"{version}"}}"#)
    );

    // The shim reports itself as an installed component, the runner as missing.
    let (status, body) = http(shim.port, "GET", "/api/components", None);
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["components"][0],
        serde_json::json!({"name": "dstack-runner", "version": "", "status": "not-installed"})
    );
    assert_eq!(
        v["components"][1],
        serde_json::json!({"name": "dstack-shim", "version": version, "status": "installed"})
    );

    let log = home.path().join("shim.log");
    let text = fs_err::read_to_string(&log).unwrap();
    assert!(text.contains("starting dstack-shim"), "{text}");
    assert_eq!(
        fs_err::metadata(&log).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let kill = Command::new("kill")
        .args(["-TERM", &shim.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = wait_exit(&mut shim.child);
    assert!(status.success(), "{status}");
    let text = fs_err::read_to_string(&log).unwrap();
    assert!(
        text.contains("dstack-shim stopped; containers keep running"),
        "{text}"
    );
    assert!(TcpStream::connect(("127.0.0.1", shim.port)).is_err());
}

#[test]
fn stops_on_api_shutdown_and_serves_a_unix_socket() {
    if !shim_e2e::docker_tests_enabled("stops_on_api_shutdown_and_serves_a_unix_socket") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let sock = home.path().join("shim.sock");
    let mut shim = start(home.path(), &["--unix-socket", sock.to_str().unwrap()]);

    let meta = fs_err::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    assert_eq!(exchange(s, "GET", "/api/healthcheck", None).0, 200);

    let (status, body) = http(
        shim.port,
        "POST",
        "/api/shutdown",
        Some(r#"{"force":false}"#),
    );
    assert_eq!((status, body.as_str()), (200, "{}"));
    let status = wait_exit(&mut shim.child);
    assert!(status.success(), "{status}");
    assert!(!sock.exists());
}

#[test]
fn unknown_task_is_404_and_the_list_is_empty() {
    if !shim_e2e::docker_tests_enabled("unknown_task_is_404_and_the_list_is_empty") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let shim = start(home.path(), &[]);
    let (status, body) = http(shim.port, "GET", "/api/tasks/abc", None);
    assert_eq!(status, 404);
    assert_eq!(body, "task abc not found");
    assert_eq!(
        http(shim.port, "GET", "/api/tasks", None),
        (200, r#"{"tasks":[]}"#.into())
    );
}

#[test]
fn service_mode_writes_host_info_once() {
    if !shim_e2e::docker_tests_enabled("service_mode_writes_host_info_once") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join("host_info.json");
    {
        let _shim = start(home.path(), &["--service", "--fake-gpus", "2"]);
        let deadline = Instant::now() + BOUND;
        while !path.exists() {
            assert!(Instant::now() < deadline, "host_info.json was not written");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let info: serde_json::Value =
        serde_json::from_str(&fs_err::read_to_string(&path).unwrap()).unwrap();
    assert!(info["cpus"].as_u64().unwrap() > 0, "{info}");
    assert!(info["memory"].as_u64().unwrap() > 0, "{info}");
    assert_eq!(info["gpu_count"], 2, "{info}");
    // Written once: a second start leaves it as it is.
    let before = fs_err::read(&path).unwrap();
    let _shim = start(home.path(), &["--service"]);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(fs_err::read(&path).unwrap(), before);
}
