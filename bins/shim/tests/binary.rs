//! The built binary: `--version`, serving, logging, signals and API shutdown.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::net::TcpStream;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use shim_e2e::harness::wait::wait_until;
use shim_e2e::harness::{Request, ShimProcess, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_dstack-shim");
const BOUND: Duration = Duration::from_secs(30);

/// Starts the binary on `home` (output to `<home>/stdio.log`) and waits until it listens.
fn start(home: &Path, extra: &[&str]) -> ShimProcess {
    let mut args = vec![
        "--runner-binary-path".to_owned(),
        home.join("no-runner").display().to_string(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let port = free_port().unwrap();
    let mut shim =
        ShimProcess::spawn(Path::new(BIN), home, port, &args, &home.join("stdio.log")).unwrap();
    shim.wait_listening(BOUND).unwrap();
    shim
}

fn http(shim: &ShimProcess, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut request = Request::new(method, path).timeout(BOUND);
    if let Some(b) = body {
        request = request.body(Some("application/json"), b);
    }
    let response = request.send(shim.addr()).unwrap();
    (response.status, response.body)
}

fn healthcheck(shim: &ShimProcess) -> (u16, String) {
    http(shim, "GET", "/api/healthcheck", None)
}

/// The healthcheck's answer.
fn healthy() -> (u16, String) {
    let body = json!({"service": "dstack-shim", "version": version()});
    (200, format!("{body}\n"))
}

/// What `--version`, the healthcheck and the components list say (one string everywhere).
fn version() -> String {
    format!(
        "{}+rust.{}",
        env!("DSTACK_SHIM_UPSTREAM_VERSION"),
        env!("CARGO_PKG_VERSION")
    )
}

/// Go's flag syntax, as upstream's urfave/cli takes it (upstream `runner/cmd/shim/main.go`):
/// one dash or two, a value after `=` or as the next argument, Go booleans, the aliases `-v`
/// and `-h`, and `help`; its refusals and their messages. `--version` prints exactly
/// `dstack-shim version X`: what the components list of this shim, and of upstream's, reads
/// back (upstream: runner/internal/shim/components/utils.go, checkDstackComponent: three
/// fields, the first the component's name).
#[test]
fn takes_gos_flag_syntax() {
    let run = |args: &[&str]| Command::new(BIN).args(args).output().unwrap();
    let printed = format!("dstack-shim version {}\n", version());
    for flag in ["-version", "--version", "-v", "--v", "-version=true"] {
        let out = run(&[flag]);
        assert!(out.status.success(), "{flag}");
        assert_eq!(String::from_utf8(out.stdout).unwrap(), printed, "{flag}");
    }
    for args in ["-help", "-h", "--help", "help", "h -nope"] {
        let out = run(&args.split(' ').collect::<Vec<_>>());
        assert!(out.status.success(), "{args}");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("--shim-home"), "{args}: {text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let home = format!("-shim-home={}", dir.path().display());
    let (home, loud) = (home.as_str(), "invalid log level: loud");
    for (args, message) in [
        (vec!["-nope"], "flag provided but not defined: -nope"),
        (
            vec!["docker", "-ssh-key", "k"],
            "flag provided but not defined: -ssh-key",
        ),
        (vec!["-shim-home="], "flag needs an argument: -shim-home="),
        (vec!["-shim-home"], "flag needs an argument: -shim-home"),
        // Values given with one dash are read: the level is refused after parsing.
        (vec![home, "-shim-log-level", "loud"], loud),
        (vec![home, "-runner-log-level=loud"], loud),
        (
            vec![home, "-privileged=maybe"],
            "could not parse \"maybe\" as bool value from the command line for flag privileged",
        ),
    ] {
        let out = run(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// A shim started with one-dash flags serves with them: the later `-shim-home` wins over the
/// harness's `--shim-home` (the last of a flag wins, as in urfave/cli), the Unix socket is
/// placed (mode 0600, served), and a positional argument (old servers start `dstack-shim
/// docker`) is ignored. `POST /api/shutdown` stops it and removes the socket.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn serves_with_one_dash_flags() {
    shim_e2e::require_docker();
    let first = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let sock = home.path().join("shim.sock");
    let args = [
        "docker".to_owned(),
        "-shim-home".to_owned(),
        home.path().display().to_string(),
        format!("-unix-socket={}", sock.display()),
        "-runner-binary-path".to_owned(),
        home.path().join("no-runner").display().to_string(),
        "-privileged=false".to_owned(),
        "-service".to_owned(),
    ];
    let port = free_port().unwrap();
    let log = first.path().join("stdio.log");
    let mut shim = ShimProcess::spawn(Path::new(BIN), first.path(), port, &args, &log).unwrap();
    shim.wait_listening(BOUND).unwrap();
    // The TCP port is bound (and accepts) a moment before the socket is placed.
    wait_until(
        "a socket and host_info.json in the home given with one dash",
        BOUND,
        || sock.exists() && home.path().join("host_info.json").exists(),
    );
    assert!(home.path().join("shim.log").exists());
    assert!(!first.path().join("shim.log").exists());
    assert_eq!(healthcheck(&shim), healthy());

    let meta = fs_err::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let over_unix = Request::get("/api/healthcheck").timeout(BOUND);
    assert_eq!(over_unix.send_unix(&sock).unwrap().status, 200);

    // Upstream answers a handler that returns nothing with Go's `http.Error(w, "", 200)`.
    let answer = http(&shim, "POST", "/api/shutdown", Some(r#"{"force":false}"#));
    assert_eq!(answer, (200, "\n".to_owned()));
    let status = shim.wait_exit(BOUND).unwrap();
    assert!(status.success(), "{status}");
    assert!(!sock.exists());
}

#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn serves_logs_and_stops_on_sigterm() {
    shim_e2e::require_docker();
    let home = tempfile::tempdir().unwrap();
    // Level 5 (debug), as the dstack server starts every shim.
    let shim = start(home.path(), &["--shim-log-level", "5"]);

    // The server's polling is not logged at debug (upstream logs a served request at trace:
    // runner/internal/common/api/api.go): it would grow the log by megabytes a day.
    for _ in 0..20 {
        assert_eq!(healthcheck(&shim), healthy());
    }

    // The shim reports itself as an installed component, the runner as missing.
    let (status, body) = http(&shim, "GET", "/api/components", None);
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let components = json!([
        {"name": "dstack-runner", "version": "", "status": "not-installed"},
        {"name": "dstack-shim", "version": version(), "status": "installed"},
    ]);
    assert_eq!(v["components"], components);

    let log = home.path().join("shim.log");
    let text = fs_err::read_to_string(&log).unwrap();
    assert!(text.contains("starting dstack-shim"), "{text}");
    assert!(text.contains("DEBUG"), "{text}");
    assert!(!text.contains("/api/healthcheck"), "{text}");
    let libraries = "the libraries log at info at most";
    assert!(!text.contains("hyper_util"), "{libraries}: {text}");
    let mode = fs_err::metadata(&log).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    let addr = shim.addr();
    shim.sigterm().unwrap();
    let status = shim.wait_exit(BOUND).unwrap();
    assert!(status.success(), "{status}");
    let text = fs_err::read_to_string(&log).unwrap();
    let stopped = "dstack-shim stopped; containers keep running";
    assert!(text.contains(stopped), "{text}");
    assert!(TcpStream::connect(addr).is_err());
}

/// A SIGTERM during the start-up install of the runner stops the shim within seconds, with
/// success: the download (a server that sends its head and a few bytes, then nothing) is
/// cancelled, not waited for until its stall timeout (60 s) fails the start.
#[test]
fn a_signal_during_the_runners_install_stops_the_shim() {
    use std::io::{BufRead, BufReader, Write};
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    server.set_nonblocking(true).unwrap();
    let url = format!("http://{}/dstack-runner", server.local_addr().unwrap());
    let home = tempfile::tempdir().unwrap();
    let runner = home.path().join("runner");
    let runner = runner.to_str().unwrap();
    let args = [
        "--runner-binary-path",
        runner,
        "--runner-download-url",
        &url,
    ];
    let log = home.path().join("stdio.log");
    let port = free_port().unwrap();
    let shim = ShimProcess::spawn(Path::new(BIN), home.path(), port, &args, &log).unwrap();
    let mut conn = None;
    wait_until("the runner's download", BOUND, || {
        conn = server.accept().ok().map(|(c, _)| c);
        conn.is_some()
    });
    let mut conn = conn.unwrap();
    conn.set_nonblocking(false).unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap() > 2 {
        line.clear();
    }
    conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\nabc")
        .unwrap();
    // The three bytes are in the download's temp file beside the target: the shim waits for
    // the rest.
    wait_until("the download's first bytes", BOUND, || {
        fs_err::read_dir(home.path()).unwrap().any(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            name.contains("runner") && name != "runner" && e.metadata().unwrap().len() == 3
        })
    });
    shim.sigterm().unwrap();
    let status = shim.wait_exit(Duration::from_secs(10)).unwrap();
    let output = fs_err::read_to_string(&log).unwrap();
    assert!(status.success(), "{status}: {output}");
    assert!(!Path::new(runner).exists());
}

/// A second shim on the same home refuses to start (it would restore, sweep and move aside
/// what the first one uses), and so does one on a taken port, before it restores anything
/// (the port is bound first). The first shim keeps serving.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn a_second_shim_on_the_same_home_or_port_refuses_to_start() {
    shim_e2e::require_docker();
    let home = tempfile::tempdir().unwrap();
    let first = start(home.path(), &[]);
    let run = |home: &Path, port: u16| {
        let (home, port) = (home.display().to_string(), port.to_string());
        let args = ["--shim-home", &home, "--shim-http-port", &port];
        Command::new(BIN).args(args).output().unwrap()
    };

    let out = run(home.path(), free_port().unwrap());
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let in_use = "another dstack-shim uses the home";
    assert!(stderr.contains(in_use), "{stderr}");

    // Another home, the first shim's port: refused before its restore runs (nothing of a
    // restore, such as the owner identity, is written).
    let other = tempfile::tempdir().unwrap();
    let out = run(other.path(), first.addr().port());
    assert!(!out.status.success());
    assert!(!other.path().join("owner-id").exists());
    assert_eq!(healthcheck(&first), healthy());
}

/// The binary's answers are upstream's, byte for byte, where the adapter decides them: an
/// unknown task, an id that cannot be one, GPU health without DCGM, task metrics without an
/// exporter (this host has no NVIDIA GPU).
///
/// upstream: runner/internal/shim/api/handlers.go (TaskInfoHandler, TaskRemoveHandler,
/// InstanceHealthHandler, TaskMetricsHandler), schemas.go (InstanceHealthResponse).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn unknown_tasks_and_unknown_health_are_answered_as_upstream() {
    shim_e2e::require_docker();
    let home = tempfile::tempdir().unwrap();
    let shim = start(home.path(), &[]);
    let not_found = (404, "Not Found\n");
    let no_task = (404, "task abc: not found\n");
    let no_exporter = (404, "DCGM Exporter is not available\n");
    let no_dcgm = (200, "{\"dcgm\":null}\n");
    for (method, path, body, (status, answer)) in [
        ("GET", "/api/tasks/abc", None, not_found),
        ("GET", "/api/tasks/-x", None, not_found),
        ("POST", "/api/tasks/abc/remove", None, no_task),
        ("POST", "/api/tasks/abc/terminate", Some("{}"), no_task),
        ("GET", "/api/tasks", None, (200, "{\"tasks\":[]}\n")),
        ("GET", "/api/instance/health", None, no_dcgm),
        ("GET", "/metrics/tasks/abc", None, no_exporter),
        ("GET", "/metrics/tasks/-x", None, no_exporter),
    ] {
        let got = http(&shim, method, path, body);
        assert_eq!(got, (status, answer.to_owned()), "{method} {path}");
    }
}

#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn service_mode_writes_host_info_once() {
    shim_e2e::require_docker();
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join("host_info.json");
    {
        let _shim = start(home.path(), &["--service", "--fake-gpus", "2"]);
        wait_until("host_info.json is written", BOUND, || path.exists());
    }
    let info: serde_json::Value =
        serde_json::from_str(&fs_err::read_to_string(&path).unwrap()).unwrap();
    assert!(info["cpus"].as_u64().unwrap() > 0, "{info}");
    assert!(info["memory"].as_u64().unwrap() > 0, "{info}");
    assert_eq!(info["gpu_count"], 2, "{info}");
    // Written once: a second start leaves it as it is.
    let before = fs_err::read(&path).unwrap();
    let _shim = start(home.path(), &["--service"]);
    let log = home.path().join("shim.log");
    wait_until("the second start decides", BOUND, || {
        fs_err::read_to_string(&log).is_ok_and(|text| text.contains("host info kept"))
    });
    assert_eq!(fs_err::read(&path).unwrap(), before);
}

/// The shim raises its open-files soft limit to the hard limit at start (logged), so 300
/// stalled connections (half of them nothing sent, half of them half a request head) do not
/// keep a normal client from being answered, even when it was started with a soft limit of
/// 256, which they would exhaust.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn stalled_connections_do_not_make_the_api_unreachable() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    use std::io::Write as _;

    shim_e2e::require_docker();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(
        hard > 1024,
        "the hard open-files limit {hard} is too low for this test"
    );
    let home = tempfile::tempdir().unwrap();
    // The shim inherits a soft limit of 256; this test process gets its own back at once.
    setrlimit(Resource::RLIMIT_NOFILE, 256, hard).unwrap();
    let started = std::panic::catch_unwind(|| start(home.path(), &[]));
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    let shim = started.unwrap();
    let limits = fs_err::read_to_string(format!("/proc/{}/limits", shim.pid())).unwrap();
    // The soft and the hard limit, in the line's 4th and 5th fields.
    let open_files = limits.lines().find(|l| l.starts_with("Max open files"));
    let fields: Vec<_> = open_files.unwrap().split_whitespace().collect();
    let (hard_text, got) = (hard.to_string(), &fields[3..5]);
    assert_eq!(got, [hard_text.as_str(); 2], "{limits}");
    let log = fs_err::read_to_string(home.path().join("shim.log")).unwrap();
    let raised = "raised the open-files limit to the hard limit";
    assert!(log.contains(raised), "{log}");

    let half = b"GET /api/healthcheck HTTP/1.1\r\nHost: x\r\nX-Half: ";
    let stalled: Vec<TcpStream> = (0..300)
        .map(|i| {
            let mut stream = TcpStream::connect(shim.addr()).unwrap();
            if i % 2 == 1 {
                stream.write_all(half).unwrap();
            }
            stream
        })
        .collect();
    assert_eq!(healthcheck(&shim), healthy());
    assert_eq!(http(&shim, "GET", "/api/tasks", None).0, 200);
    drop(stalled);
}
