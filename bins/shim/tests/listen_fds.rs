//! Socket activation: the binary serves a listening socket passed as systemd passes it
//! (`sd_listen_fds`: fd 3, `LISTEN_FDS=1`, `LISTEN_PID` = the process) instead of binding its
//! port, and refuses one that is not on a loopback address.
//!
//! systemd is not here: a Python one-liner stands in for it (binds and listens, moves the
//! socket to fd 3, sets the variables with its own PID and `exec`s the binary, so the PID is
//! the binary's), as `systemd-socket-activate` does.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use shim_e2e::harness::wait::wait_until;
use shim_e2e::harness::{Request, ShimProcess, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_dstack-shim");
const BOUND: Duration = Duration::from_secs(60);

/// Binds `addr:port`, listens, and execs `BIN args..` with the socket at fd 3.
const ACTIVATE: &str = r#"
import os, socket, sys
addr, port, binary = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port))
s.listen(128)
if s.fileno() != 3:
    os.dup2(s.fileno(), 3)
os.set_inheritable(3, True)
env = dict(os.environ, LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="api")
os.execve(binary, sys.argv[3:], env)
"#;

fn activated(addr: &str, port: u16, home: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new("python3");
    command
        .args(["-c", ACTIVATE, addr, &port.to_string(), BIN])
        .arg("--shim-home")
        .arg(home)
        .arg("--runner-binary-path")
        .arg(home.join("no-runner"))
        .args(extra)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1");
    command
}

/// The passed socket is served: the configured port is that socket's, which the binary could
/// not bind again (it is taken by the very socket it serves), yet the healthcheck answers; the
/// listening socket is the one passed (fd 3 of the process).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn serves_a_socket_passed_as_systemd_passes_it() {
    shim_e2e::require_docker();
    let home = tempfile::tempdir().unwrap();
    let port = free_port().unwrap();
    let port_arg = port.to_string();
    let command = activated(
        "127.0.0.1",
        port,
        home.path(),
        &["--shim-http-port", &port_arg],
    );
    let log = home.path().join("stdio.log");
    let mut shim = ShimProcess::from_command(command, port, &log).unwrap();
    shim.wait_answering(BOUND, Duration::from_millis(20))
        .unwrap_or_else(|e| panic!("{e}"));
    let answer = Request::get("/api/healthcheck").send(shim.addr()).unwrap();
    assert_eq!(answer.status, 200);
    let fd3 = fs_err::read_link(format!("/proc/{}/fd/3", shim.pid())).unwrap();
    let fd3 = fd3.to_string_lossy();
    assert!(
        fd3.starts_with("socket:"),
        "fd 3 is the passed socket: {fd3}"
    );
    let text = fs_err::read_to_string(&log).unwrap();
    let passed = "serving the listening socket passed by the parent";
    assert!(text.contains(passed), "{text}");
    // Passed to no child: a shutdown (nothing new installed) exits, and the port is free.
    let answer = Request::post("/api/shutdown")
        .json(&serde_json::json!({"force": false}))
        .send(shim.addr())
        .unwrap();
    assert_eq!(answer.status, 200);
    assert!(shim.wait_exit(BOUND).unwrap().success());
    wait_until(&format!("port {port} is free"), BOUND, || {
        TcpStream::connect(("127.0.0.1", port)).is_err()
    });
}

/// A passed socket bound to every address is refused: the API is loopback-only whoever made
/// the socket.
#[test]
fn refuses_a_passed_socket_that_is_not_loopback() {
    let home = tempfile::tempdir().unwrap();
    let port = free_port().unwrap();
    let out = activated("0.0.0.0", port, home.path(), &[]).output();
    let out = out.unwrap();
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refused = format!("refusing to listen on 0.0.0.0:{port}: the shim API is loopback-only");
    assert!(stderr.contains(&refused), "{stderr}");
}

/// `LISTEN_PID` of another process (the parent's variables, inherited) is ignored: the binary
/// binds its port itself.
#[test]
fn ignores_variables_for_another_process_and_refuses_bad_ones() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .arg("--version")
        .env("LISTEN_PID", "1")
        .env("LISTEN_FDS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // Meant for this process but malformed: a clear error before anything else.
    let out = Command::new("sh")
        .args([
            "-c",
            "LISTEN_PID=$$ LISTEN_FDS=2 exec \"$0\" --shim-home \"$1\"",
            BIN,
        ])
        .arg(home.path())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refused = "LISTEN_FDS=2: this shim serves one socket";
    assert!(stderr.contains(refused), "{stderr}");
}
