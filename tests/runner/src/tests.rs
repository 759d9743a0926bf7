//! The runner served on a loopback port and driven as the dstack server drives it, with jobs
//! run by the host's `/bin/sh`.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::Instant;

use super::*;
use crate::json::Value;

struct Served {
    addr: SocketAddr,
    runner: Arc<Runner>,
}

fn served() -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let runner = Runner::new("9.9.9");
    let server = Arc::clone(&runner);
    std::thread::spawn(move || serve(listener, &server));
    Served { addr, runner }
}

/// One request; the status and the body.
fn call(addr: SocketAddr, method: &str, target: &str, ctype: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !ctype.is_empty() {
        head.push_str(&format!("Content-Type: {ctype}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer.split_once("\r\n\r\n").unwrap().1.to_owned();
    (status, body)
}

fn submit_body(commands: &[&str], env: &str) -> String {
    let commands: Vec<String> = commands.iter().map(|c| json::quote(c)).collect();
    format!(
        r#"{{"run":{{"id":"r1","run_spec":{{"run_name":"my-run","repo_id":"x","configuration":{{"type":"task"}}}}}},
            "job_spec":{{"commands":[{}],"env":{env},"working_dir":null,"user":{{"uid":0,"username":"root"}},
                         "max_duration":null,"job_num":0,"jobs_per_replica":1,"unknown":[1,{{"a":null}}]}},
            "job_submission":{{"id":"sub-1"}},"cluster_info":{{"job_ips":[]}},"secrets":{{}},
            "repo_credentials":null,"run_spec":{{"run_name":"my-run"}}}}"#,
        commands.join(",")
    )
}

/// Submits and runs `commands`; the JSON of `run`'s answer.
fn start_job(addr: SocketAddr, commands: &[&str], env: &str) -> Value {
    let (status, body) = call(addr, "POST", "/api/run", "", b"");
    assert_eq!(
        (status, body.as_str()),
        (409, "Conflict\n"),
        "run before submit"
    );
    let (status, body) = call(
        addr,
        "POST",
        "/api/submit",
        "application/json",
        submit_body(commands, env).as_bytes(),
    );
    assert_eq!((status, body.as_str()), (200, "\n"));
    let multipart = b"--b\r\nContent-Disposition: form-data; name=\"archive\"; filename=\"id-1\"\r\n\r\nxyz\r\n--b--\r\n";
    let (status, _) = call(
        addr,
        "POST",
        "/api/upload_archive",
        "multipart/form-data; boundary=b",
        multipart,
    );
    assert_eq!(status, 200);
    let (status, _) = call(addr, "POST", "/api/upload_code", "", b"");
    assert_eq!(status, 200);
    let (status, body) = call(addr, "POST", "/api/run", "", b"");
    assert_eq!(status, 200, "{body}");
    json::parse(&body).unwrap()
}

/// Everything pulled until the runner says it has no more: (job states, job log text, runner
/// log text, the pulls made).
/// The job's output so far, from one `GET /api/pull?timestamp=0` (no waiting).
fn job_logs_so_far(addr: SocketAddr) -> String {
    let (status, body) = call(addr, "GET", "/api/pull?timestamp=0", "", b"");
    assert_eq!(status, 200, "{body}");
    let answer = json::parse(&body).unwrap();
    answer
        .get("job_logs")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|event| decode_base64(event.get("message").unwrap().as_str().unwrap()))
        .collect()
}

fn pull_all(addr: SocketAddr) -> (Vec<Value>, String, String, usize) {
    let started = Instant::now();
    let (mut states, mut logs, mut runner_logs, mut timestamp, mut pulls) =
        (Vec::new(), String::new(), String::new(), 0i64, 0);
    loop {
        let (status, body) = call(
            addr,
            "GET",
            &format!("/api/pull?timestamp={timestamp}"),
            "",
            b"",
        );
        assert_eq!(status, 200, "{body}");
        pulls += 1;
        let answer = json::parse(&body).unwrap();
        states.extend(
            answer
                .get("job_states")
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .cloned(),
        );
        for (key, text) in [("job_logs", &mut logs), ("runner_logs", &mut runner_logs)] {
            for event in answer.get(key).unwrap().as_array().unwrap() {
                assert!(event.get("timestamp").unwrap().as_i64().unwrap() > timestamp);
                text.push_str(&decode_base64(
                    event.get("message").unwrap().as_str().unwrap(),
                ));
            }
        }
        timestamp = answer.get("last_updated").unwrap().as_i64().unwrap();
        if answer.get("has_more") == Some(&Value::Bool(false)) {
            return (states, logs, runner_logs, pulls);
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no end: {states:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn decode_base64(text: &str) -> String {
    const ALPHABET: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in text.chars().filter(|c| *c != '=') {
        bits = (bits << 6) | ALPHABET.find(c).unwrap() as u32;
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn state_names(states: &[Value]) -> Vec<&str> {
    states
        .iter()
        .map(|s| s.get("state").unwrap().as_str().unwrap())
        .collect()
}

#[test]
fn command_line_as_the_shim_gives_it() {
    let args = |s: &str| s.split(' ').map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(parse_args(&args("--version")), Ok(Cli::Version));
    assert_eq!(
        parse_args(&args(
            "--log-level 5 start --temp-dir /tmp/runner --http-port 10999 --ssh-port 10022 \
             --http-address localhost --ssh-authorized-key k1 --ssh-authorized-key=k2 \
             -ssh-log-level debug"
        )),
        Ok(Cli::Start(Start {
            http_address: "localhost".into(),
            http_port: 10999,
            ssh_port: 10022,
            temp_dir: "/tmp/runner".into(),
            ssh_keys: 2,
        }))
    );
    assert!(parse_args(&args("--log-level 5")).is_err());
    assert!(parse_args(&args("start --http-port x")).is_err());
    assert!(parse_args(&args("start --bogus 1")).is_err());
    assert_eq!(
        listen_addr("localhost", 1),
        Ok(SocketAddr::from(([127, 0, 0, 1], 1)))
    );
    assert_eq!(listen_addr("", 2), Ok(SocketAddr::from(([0, 0, 0, 0], 2))));
    assert!(listen_addr("example.com", 3).is_err());
    assert_eq!(
        VERSION,
        include_str!("../../../bins/shim/upstream-version").trim()
    );
}

#[test]
fn a_job_that_fails_reports_its_exit_status_and_output() {
    let s = served();
    let (status, body) = call(s.addr, "GET", "/api/healthcheck", "", b"");
    assert_eq!(status, 200);
    assert_eq!(
        json::parse(&body).unwrap(),
        json::parse(r#"{"service":"dstack-runner","version":"9.9.9"}"#).unwrap()
    );
    assert_eq!(call(s.addr, "GET", "/api/metrics", "", b"").0, 404);
    assert_eq!(call(s.addr, "GET", "/nope", "", b"").0, 404);
    assert_eq!(call(s.addr, "POST", "/api/pull", "", b"").0, 405);
    assert_eq!(
        call(s.addr, "POST", "/api/submit", "text/plain", b"{}").0,
        415
    );
    assert_eq!(
        call(s.addr, "POST", "/api/submit", "application/json", b"{").0,
        400
    );
    let info = start_job(
        s.addr,
        &[
            "/bin/sh",
            "-c",
            "echo out $GREETING $DSTACK_RUN_NAME; echo err >&2; exit 3",
        ],
        r#"{"GREETING":"hello","SHIM_TEST_RUNNER_EXIT_AFTER_PULL":"1"}"#,
    );
    assert_eq!(info.get("username").unwrap().as_str(), Some("root"));
    assert!(
        info.get("working_dir")
            .unwrap()
            .as_str()
            .unwrap()
            .starts_with('/')
    );
    assert_eq!(
        call(s.addr, "POST", "/api/submit", "application/json", b"{}").0,
        409
    );
    let (states, logs, runner_logs, _) = pull_all(s.addr);
    assert_eq!(state_names(&states), ["running", "failed"], "{states:?}");
    assert_eq!(states[1].get("exit_status").unwrap().as_i64(), Some(3));
    assert_eq!(
        states[1].get("termination_reason").unwrap().as_str(),
        Some("")
    );
    assert!(logs.contains("out hello my-run\n"), "{logs:?}");
    assert!(logs.contains("err\n"), "{logs:?}");
    assert!(
        runner_logs.contains("File archive 1 received"),
        "{runner_logs}"
    );
    assert_eq!(s.runner.wait_end(WAIT, WAIT), End::Done);
}

#[test]
fn a_job_that_succeeds_is_done_and_a_stopped_one_terminated() {
    let s = served();
    start_job(s.addr, &["/bin/sh", "-c", "echo fine"], "{}");
    let (states, logs, _, _) = pull_all(s.addr);
    assert_eq!(state_names(&states), ["running", "done"], "{states:?}");
    assert_eq!(states[1].get("exit_status").unwrap().as_i64(), Some(0));
    assert_eq!(logs, "fine\n");
    // Upstream without an attached CLI: it lives on after the last pull (until the server
    // stops the container, or the logs wait passes).
    let (ended, end) = std::sync::mpsc::channel();
    let runner = Arc::clone(&s.runner);
    std::thread::spawn(move || ended.send(runner.wait_end(WAIT, Duration::from_secs(1))));
    assert!(end.recv_timeout(Duration::from_millis(300)).is_err());
    assert_eq!(end.recv_timeout(WAIT).unwrap(), End::Done);
    let answer = call(s.addr, "GET", "/api/pull?timestamp=0", "", b"").1;
    assert!(answer.contains(r#""has_more":false"#), "{answer}");

    let s = served();
    start_job(
        s.addr,
        &["/bin/sh", "-c", "echo begun; sleep 60; echo never"],
        "{}",
    );
    // Stopped once it has printed its first line: "running" alone is no proof that the shell
    // has run its `echo` yet (on a loaded machine the stop came first and nothing was logged).
    let started = Instant::now();
    while !job_logs_so_far(s.addr).contains("begun") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the job never printed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopped = Instant::now();
    assert_eq!(call(s.addr, "POST", "/api/stop", "", b"").0, 200);
    let (states, logs, _, _) = pull_all(s.addr);
    assert_eq!(
        state_names(&states),
        ["running", "terminated"],
        "{states:?}"
    );
    assert!(logs.contains("begun") && !logs.contains("never"), "{logs}");
    if sigint_ignored() {
        // Started where SIGINT is ignored (a background job of a shell without job control):
        // the job inherits that, and only the SIGKILL after the delay ends it.
        assert!(
            stopped.elapsed() < crate::runner::KILL_DELAY + Duration::from_secs(5),
            "SIGKILL after the delay ends the job that ignores SIGINT"
        );
    } else {
        assert!(
            stopped.elapsed() < crate::runner::KILL_DELAY,
            "SIGINT to the process group ends sh and its sleep"
        );
    }
}

/// Whether this process ignores SIGINT (bit 2 of `SigIgn` in `/proc/self/status`), which the
/// job's processes inherit.
fn sigint_ignored() -> bool {
    let status = fs_err::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (2 - 1)) != 0)
}

#[test]
fn without_a_job_it_gives_up() {
    let s = served();
    assert_eq!(
        s.runner.wait_end(Duration::from_millis(100), WAIT),
        End::NoJob
    );
}

#[test]
fn a_command_that_cannot_start_fails_the_job() {
    let s = served();
    start_job(s.addr, &["/nonexistent/shell"], "{}");
    let (states, _, runner_logs, _) = pull_all(s.addr);
    assert_eq!(state_names(&states), ["running", "failed"], "{states:?}");
    let message = states[1]
        .get("termination_message")
        .unwrap()
        .as_str()
        .unwrap();
    assert!(message.contains("/nonexistent/shell"), "{message}");
    assert!(
        runner_logs.contains("Job state changed new=failed"),
        "{runner_logs}"
    );
}
