//! `shim-test-runner`: a stand-in for dstack's runner (`dstack-runner`) that the fleet test
//! (`tests/tests/fleet.rs`) puts where the dstack server's `DSTACK_RUNNER_DOWNLOAD_URL` points,
//! so that a real dstack server runs jobs through the shim under test without the Go runner.
//!
//! It takes upstream's command line (`dstack-runner [--log-level L] start --temp-dir D
//! --http-port P --ssh-port S [--http-address A] [--ssh-authorized-key K].. [--ssh-log-level
//! L]`; `--version` prints `dstack-runner version <release>`, the dstack release this workspace
//! speaks for, so the server's instance check finds the runner it expects), serves the runner's
//! HTTP API as the server uses it (see [`runner`]), and runs the job's command line as given
//! (the server sends `[shell, "-i", "-c", commands]`: the image's busybox `sh`) with its output
//! as job logs and its exit as the job's state. It does not start sshd, serve `/logs_ws`, set
//! up repos, users, files or cluster SSH, or report metrics. After the job it lives on as
//! upstream's does (see [`runner`] for when it exits).
//!
//! Pure Rust (serde_json for the JSON, tiny_http for the HTTP), so that a static build (`-C
//! target-feature=+crt-static`) runs in the busybox test image; the harness builds it
//! (`shim_e2e::harness::build_test_runner`).

mod http;
mod runner;
mod schemas;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use runner::{End, Runner};

/// The dstack release the runner reports (`bins/shim/upstream-version`, kept once).
const VERSION: &str = include_str!("../../../bins/shim/upstream-version").trim_ascii();
/// How long the runner waits for a job, and for the last pull after it (upstream: 5 min each).
const WAIT: Duration = Duration::from_secs(300);

/// Writes `line` to `stream`, ignoring failures.
fn write_line(mut stream: impl std::io::Write, line: &str) {
    let _ = writeln!(stream, "{line}");
}

/// A log line of the runner's own, on stderr (the container's log).
pub fn log(line: &str) {
    write_line(std::io::stderr(), &format!("shim-test-runner: {line}"));
}

/// The `start` command's settings.
#[derive(Debug, PartialEq, Eq)]
struct Start {
    http_address: String,
    http_port: u16,
    ssh_port: u16,
    temp_dir: String,
    ssh_keys: usize,
}

#[derive(Debug, PartialEq, Eq)]
enum Cli {
    Version,
    Start(Start),
}

/// Parses upstream's command line (urfave/cli: `--flag value` or `--flag=value`, one or two
/// dashes).
fn parse_args(args: &[String]) -> Result<Cli, String> {
    let mut start = Start {
        http_address: String::new(),
        http_port: 10999,
        ssh_port: 10022,
        temp_dir: "/tmp/runner".to_owned(),
        ssh_keys: 0,
    };
    let mut command = None;
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "start" {
            command = Some("start");
            continue;
        }
        let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
            return Err(format!("unexpected argument {arg:?}"));
        };
        if matches!(flag, "version" | "v") {
            return Ok(Cli::Version);
        }
        let (name, value) = match flag.split_once('=') {
            Some((name, value)) => (name, value.to_owned()),
            None => {
                let value = args
                    .get(i)
                    .ok_or_else(|| format!("flag --{flag} needs a value"))?
                    .clone();
                i += 1;
                (flag, value)
            }
        };
        let port = |v: &str| v.parse::<u16>().map_err(|_| format!("bad port {v:?}"));
        match name {
            "log-level" | "ssh-log-level" | "home-dir" => {}
            "temp-dir" => start.temp_dir = value,
            "http-address" => start.http_address = value,
            "http-port" => start.http_port = port(&value)?,
            "ssh-port" => start.ssh_port = port(&value)?,
            "ssh-authorized-key" => start.ssh_keys += 1,
            _ => return Err(format!("unknown flag --{name}")),
        }
    }
    match command {
        Some(_) => Ok(Cli::Start(start)),
        None => Err("no command: expected `start` or `--version`".to_owned()),
    }
}

/// The address to listen on: upstream's Go listens on `host:port`; `localhost` is taken as
/// 127.0.0.1 (a static binary in a busybox image has no resolver), empty as all interfaces.
fn listen_addr(address: &str, port: u16) -> Result<SocketAddr, String> {
    let ip = match address {
        "" => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        other => other
            .parse()
            .map_err(|_| format!("bad --http-address {other:?}"))?,
    };
    Ok(SocketAddr::new(ip, port))
}

/// Serves the runner's API on `server` (blocks); an answer of 400 or more is logged.
fn serve(server: &tiny_http::Server, runner: &Arc<Runner>) {
    let runner = Arc::clone(runner);
    http::serve(
        server,
        Arc::new(move |request: &http::Request| {
            let response = runner.handle(request);
            if response.status >= 400 {
                log(&format!(
                    "{} {}: {}",
                    request.method, request.path, response.status
                ));
            }
            response
        }),
    );
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let start = match parse_args(&args) {
        Ok(Cli::Version) => {
            write_line(
                std::io::stdout(),
                &format!("dstack-runner version {VERSION}"),
            );
            return ExitCode::SUCCESS;
        }
        Ok(Cli::Start(start)) => start,
        Err(e) => {
            log(&e);
            return ExitCode::from(2);
        }
    };
    let addr = match listen_addr(&start.http_address, start.http_port) {
        Ok(addr) => addr,
        Err(e) => {
            log(&e);
            return ExitCode::from(2);
        }
    };
    let server = match TcpListener::bind(addr)
        .map_err(|e| e.to_string())
        .and_then(|listener| {
            tiny_http::Server::from_listener(listener, None).map_err(|e| e.to_string())
        }) {
        Ok(server) => server,
        Err(e) => {
            log(&format!("cannot listen on {addr}: {e}"));
            return ExitCode::FAILURE;
        }
    };
    log(&format!(
        "version {VERSION} listening on {addr} (temp dir {}, ssh port {} not served, {} \
         authorized keys)",
        start.temp_dir, start.ssh_port, start.ssh_keys
    ));
    let runner = Runner::new(VERSION);
    let served = Arc::clone(&runner);
    std::thread::spawn(move || serve(&server, &served));
    match runner.wait_end(WAIT, WAIT) {
        End::Done => {
            log("job finished and its logs were given: exiting");
            // Let the answer to the last pull leave before the process (and the container) ends.
            std::thread::sleep(Duration::from_millis(200));
            ExitCode::SUCCESS
        }
        End::NoJob => {
            log("no job was submitted and run in time: exiting");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests;
