//! The runner served on a loopback port and driven as the dstack server drives it, with jobs
//! run by the host's `/bin/sh`.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::Instant;

use base64::Engine as _;
use serde_json::{Value, json};

use super::*;

struct Served {
    addr: SocketAddr,
    runner: Arc<Runner>,
}

fn served() -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tiny_http::Server::from_listener(listener, None).unwrap();
    let runner = Runner::new("9.9.9");
    let served = Arc::clone(&runner);
    std::thread::spawn(move || serve(&server, &served));
    Served { addr, runner }
}

/// Sends `raw` on a connection of its own and reads until the server closes it.
fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(raw).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

/// The status, the headers (names lowercased) and the body of one answer.
fn parse_answer(answer: &str) -> (u16, Vec<(String, String)>, String) {
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap()[9..12].parse().unwrap();
    let headers = lines
        .map(|l| l.split_once(':').unwrap())
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

/// One request (`Connection: close`, the body by `Content-Length`); the status and the body.
fn call(addr: SocketAddr, method: &str, target: &str, ctype: &str, body: &[u8]) -> (u16, String) {
    let mut raw = format!(
        "{method} {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    if !ctype.is_empty() {
        raw.push_str(&format!("Content-Type: {ctype}\r\n"));
    }
    raw.push_str("\r\n");
    let mut raw = raw.into_bytes();
    raw.extend_from_slice(body);
    let (status, _, body) = parse_answer(&exchange(addr, &raw));
    (status, body)
}

/// A submit body as the server writes it (pydantic: unset members as `null`, members this
/// runner does not read).
fn submit_body(commands: &[&str], env: &Value) -> String {
    json!({
        "run": {"id": "r1", "run_spec": {"run_name": "my-run", "repo_id": "x",
                                         "configuration": {"type": "task"}}},
        "job_spec": {"commands": commands, "env": env, "working_dir": null,
                     "user": {"uid": 0, "username": "root"}, "max_duration": null,
                     "job_num": 0, "jobs_per_replica": 1, "unknown": [1, {"a": null}]},
        "job_submission": {"id": "sub-1"}, "cluster_info": {"job_ips": []}, "secrets": {},
        "repo_credentials": null, "run_spec": {"run_name": "my-run"}
    })
    .to_string()
}

/// Submits and runs `commands`; the JSON of `run`'s answer.
fn start_job(addr: SocketAddr, commands: &[&str], env: &Value) -> Value {
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
    serde_json::from_str(&body).unwrap()
}

/// The job's output so far, from one `GET /api/pull?timestamp=0` (no waiting).
fn job_logs_so_far(addr: SocketAddr) -> String {
    let (status, body) = call(addr, "GET", "/api/pull?timestamp=0", "", b"");
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    answer["job_logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| decode_base64(event["message"].as_str().unwrap()))
        .collect()
}

/// Everything pulled until the runner says it has no more: (job states, job log text, runner
/// log text, the pulls made).
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
        let answer: Value = serde_json::from_str(&body).unwrap();
        states.extend(answer["job_states"].as_array().unwrap().iter().cloned());
        for (key, text) in [("job_logs", &mut logs), ("runner_logs", &mut runner_logs)] {
            for event in answer[key].as_array().unwrap() {
                assert!(event["timestamp"].as_i64().unwrap() > timestamp);
                text.push_str(&decode_base64(event["message"].as_str().unwrap()));
            }
        }
        timestamp = answer["last_updated"].as_i64().unwrap();
        if answer["has_more"] == Value::Bool(false) {
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
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

fn state_names(states: &[Value]) -> Vec<&str> {
    states
        .iter()
        .map(|s| s["state"].as_str().unwrap())
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
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"service": "dstack-runner", "version": "9.9.9"})
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
        &json!({"GREETING": "hello", "SHIM_TEST_RUNNER_EXIT_AFTER_PULL": "1"}),
    );
    assert_eq!(info["username"].as_str(), Some("root"));
    assert!(info["working_dir"].as_str().unwrap().starts_with('/'));
    assert_eq!(
        call(s.addr, "POST", "/api/submit", "application/json", b"{}").0,
        409
    );
    let (states, logs, runner_logs, _) = pull_all(s.addr);
    assert_eq!(state_names(&states), ["running", "failed"], "{states:?}");
    assert_eq!(states[1]["exit_status"].as_i64(), Some(3));
    assert_eq!(states[1]["termination_reason"].as_str(), Some(""));
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
    start_job(s.addr, &["/bin/sh", "-c", "echo fine"], &json!({}));
    let (states, logs, _, _) = pull_all(s.addr);
    assert_eq!(state_names(&states), ["running", "done"], "{states:?}");
    assert_eq!(states[1]["exit_status"].as_i64(), Some(0));
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
        &json!({}),
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
    start_job(s.addr, &["/nonexistent/shell"], &json!({}));
    let (states, _, runner_logs, _) = pull_all(s.addr);
    assert_eq!(state_names(&states), ["running", "failed"], "{states:?}");
    let message = states[1]["termination_message"].as_str().unwrap();
    assert!(message.contains("/nonexistent/shell"), "{message}");
    assert!(
        runner_logs.contains("Job state changed new=failed"),
        "{runner_logs}"
    );
}

#[test]
fn http_as_clients_send_it() {
    let s = served();
    // Answers as Go's net/http writes them: a length, the type, a trailing newline.
    let (status, headers, body) = parse_answer(&exchange(
        s.addr,
        b"GET /api/healthcheck HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ));
    assert_eq!(status, 200);
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("content-type").as_deref(), Some("application/json"));
    assert_eq!(header("content-length"), Some(body.len().to_string()));
    assert!(body.ends_with("}\n"), "{body:?}");
    let (status, headers, body) = parse_answer(&exchange(
        s.addr,
        b"GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n",
    ));
    assert_eq!((status, body.as_str()), (404, "404 page not found\n"));
    assert!(
        headers.contains(&("content-type".into(), "text/plain; charset=utf-8".into())),
        "{headers:?}"
    );
    // Keep-alive: two requests on one connection (the server's HTTP client keeps them open).
    let answers = exchange(
        s.addr,
        b"GET /api/healthcheck HTTP/1.1\r\n\r\nGET /api/pull?timestamp=0 HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(
        answers.matches("HTTP/1.1 200 OK\r\n").count(),
        2,
        "{answers}"
    );
    assert!(answers.contains(r#""has_more":true"#), "{answers}");
    // The query: other parameters and flags beside `timestamp`; a bad timestamp is refused.
    assert_eq!(
        call(s.addr, "GET", "/api/pull?x&timestamp=17&y=1", "", b"").0,
        200
    );
    assert_eq!(
        call(s.addr, "GET", "/api/pull?timestamp=soon", "", b"").0,
        400
    );
    // A chunked body.
    let body = submit_body(&["/bin/sh", "-c", "true"], &json!({}));
    let mut raw = b"POST /api/submit HTTP/1.1\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for chunk in body.as_bytes().chunks(100) {
        raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        raw.extend_from_slice(chunk);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let (status, _, body) = parse_answer(&exchange(s.addr, &raw));
    assert_eq!((status, body.as_str()), (200, "\n"));
    assert_eq!(call(s.addr, "POST", "/api/run", "", b"").0, 200);
    // Not HTTP.
    assert!(
        exchange(s.addr, b"garbage\r\n\r\n").starts_with("HTTP/1.1 400 "),
        "a request line that is not one"
    );
}

#[test]
fn submit_bodies_the_runner_takes_and_refuses() {
    let s = served();
    let submit = |body: &str| {
        call(
            s.addr,
            "POST",
            "/api/submit",
            "application/json; charset=utf-8",
            body.as_bytes(),
        )
    };
    for (body, refusal) in [
        ("", "badly-formed JSON"),
        (r#"{"job_spec": {"commands": ["sh"]}"#, "badly-formed JSON"),
        (
            r#"{"job_spec": {"commands": ["sh"]}} x"#,
            "badly-formed JSON",
        ),
        (r#"{"run": {}}"#, "missing field `job_spec`"),
        (r#"{"job_spec": {"commands": "sh"}}"#, "invalid value"),
        (r#"{"job_spec": {"commands": ["sh", 1]}}"#, "invalid value"),
        (
            r#"{"job_spec": {"commands": ["sh"], "max_duration": "1h"}}"#,
            "invalid value",
        ),
        (
            r#"{"job_spec": {"commands": []}}"#,
            "job_spec.commands is empty",
        ),
    ] {
        let (status, answer) = submit(body);
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer.contains(refusal), "{body}: {answer}");
    }
    // What pydantic writes for unset members: `null`; a variable that is not a string is
    // ignored; a repeated member: the last one.
    let script = "v=\"$DSTACK_RUN_ID|$DSTACK_RUN_NAME|$DSTACK_NODE_RANK|$DSTACK_NODES_NUM|$A|${B-unset}\"; \
                  [ \"$v\" = '||0|1|a|unset' ] || { echo \"$v\"; exit 9; }; printf 'foobar\\n'";
    let (status, answer) = submit(&format!(
        r#"{{"run": null, "job_submission": null, "job_spec": {{"commands": ["/bin/sh", "-c", {}],
            "env": {{"A": "1", "B": 2, "A": "a"}}, "user": null, "working_dir": null,
            "max_duration": null, "job_num": null, "jobs_per_replica": null}}}}"#,
        serde_json::to_string(script).unwrap()
    ));
    assert_eq!((status, answer.as_str()), (200, "\n"));
    let (status, info) = call(s.addr, "POST", "/api/run", "", b"");
    assert_eq!(status, 200, "{info}");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["username"], "root");
    let (states, logs, runner_logs, _) = pull_all(s.addr);
    // The variables as expected (else the job prints them and fails), then one write.
    assert_eq!(
        state_names(&states),
        ["running", "done"],
        "{states:?} {logs:?}"
    );
    assert_eq!(logs, "foobar\n");
    // The runner's log line quotes its message (logrus's text format).
    assert!(
        runner_logs.contains(r#"level=info msg="Job submitted: commands [\"/bin/sh\", "#),
        "{runner_logs}"
    );
    // Output bytes as Go encodes a []byte: standard base64 with padding.
    let (_, raw) = call(s.addr, "GET", "/api/pull?timestamp=0", "", b"");
    assert!(raw.contains(r#""message":"Zm9vYmFyCg==""#), "{raw}");
}
