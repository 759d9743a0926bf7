//! Real HTTP requests over TCP (and a Unix socket) against the server, with a fake engine.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

mod common;

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    ANSWER_BOUND as BOUND, FakeComponents, FakeEngine, Resp, Server, exchange, get, parse_response,
    post, raw, request_bytes, serve_returns, start_server, stop,
};
use serde_json::json;
use shim_components::ComponentName;
use shim_http::{ConnectionLimits, HttpError, Listeners, ServerConfig, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

async fn start() -> Server {
    start_server(None, |c| c).await
}

async fn start_limited(limits: ConnectionLimits) -> Server {
    start_server(None, |c| c.with_limits(limits)).await
}

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAABAgMEBQYHCAkKCwwNDg8QERITFBUWFxgZGhscHR4f user@host";

fn submit_body(id: &str) -> String {
    // What dstack's Python ShimClient sends (every field present), plus a field from the future.
    json!({
        "id": id, "name": "job-1", "registry_username": "", "registry_password": "",
        "image_name": "shim-test:1", "container_user": "", "privileged": false,
        "gpu": -1, "cpu": 0, "memory": 0, "shm_size": 0, "network_mode": "host",
        "volumes": [], "volume_mounts": [], "instance_mounts": [], "gpu_devices": [],
        "host_ssh_user": "", "host_ssh_keys": [], "container_ssh_keys": [],
        "some_future_field": {"x": 1}
    })
    .to_string()
}

// ---------------------------------------------------------------------------------------------
// Routes.

#[tokio::test]
async fn task_lifecycle_routes() {
    let s = start().await;
    assert_eq!(s.get("/api/tasks").await.json(), json!({"tasks": []}));

    // Submit answers with the Go field names of upstream's runner TaskInfo, which has no JSON
    // tags (upstream: runner/internal/shim/api/handlers.go, TaskSubmitHandler, returns
    // `s.runner.TaskInfo(..)`; runner/internal/shim/models.go, TaskInfo).
    let r = s.post("/api/tasks", &submit_body("t1")).await;
    r.assert_answer(
        200,
        Some("application/json"),
        "{\"ID\":\"t1\",\"Status\":\"pending\",\"TerminationReason\":\"\",\
         \"TerminationMessage\":\"\",\"Ports\":null,\"ImagePullProgress\":null,\
         \"ContainerName\":\"t1-0123abcd\",\"ContainerID\":\"\",\"GpuIDs\":null}\n",
    );
    let r = s.post("/api/tasks", &submit_body("t1")).await;
    r.assert_error(409, "task t1 already exists");

    let v = s.get("/api/tasks").await.json();
    assert_eq!(v, json!({"tasks": [{"id": "t1", "status": "pending"}]}));
    // Every other TaskInfo answer has upstream's JSON names (`gpus_ids`, so spelled).
    // upstream: runner/internal/shim/api/schemas.go (TaskInfoResponse).
    s.get("/api/tasks/t1").await.assert_answer(
        200,
        Some("application/json"),
        "{\"id\":\"t1\",\"status\":\"pending\",\"termination_reason\":\"\",\
         \"termination_message\":\"\",\"ports\":null,\"image_pull_progress\":null,\
         \"container_name\":\"t1-0123abcd\",\"container_id\":\"\",\"gpus_ids\":null}\n",
    );
    let r = s.post("/api/tasks/t1/remove", "{}").await;
    r.assert_error(409, "task t1 is not terminated");

    // What the Python client sends, then every terminate field is optional.
    let terminate = "POST /api/tasks/t1/terminate";
    let by_user = "{\"termination_reason\":\"terminated_by_user\",\"termination_message\":\"bye\",\
                   \"timeout\":10}";
    let r = s.ask(&format!("{terminate} {by_user}")).await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v["status"], "terminated");
    assert_eq!(v["termination_reason"], "terminated_by_user");
    assert_eq!(v["termination_message"], "bye");
    for body in ["{}", r#"{"termination_reason":null,"timeout":null}"#] {
        let r = s.ask(&format!("{terminate} {body}")).await;
        assert_eq!(r.status, 200, "{r:?}");
    }
    let by_user = (
        "t1".to_owned(),
        "terminated_by_user".to_owned(),
        "bye".to_owned(),
        10,
    );
    let defaults = || ("t1".to_owned(), String::new(), String::new(), 0);
    let asked = [by_user, defaults(), defaults()];
    assert_eq!(*s.engine.terminations.lock().unwrap(), asked);

    // Remove sends no body at all (Python passes json=None); upstream answers it as every
    // handler that returns nothing.
    s.ask("POST /api/tasks/t1/remove").await.assert_empty_ok();
    // Unknown tasks: upstream's messages (handlers.go: TaskInfoHandler's bare 404; the
    // runner's `task %s: not found` for terminate and remove).
    let r = s.post("/api/tasks/t1/remove", "").await;
    r.assert_error(404, "task t1: not found");
    s.assert_refusals(&[
        "info: GET /api/tasks/t1 => 404 Not Found",
        "terminate: POST /api/tasks/t1/terminate {} => 404 task t1: not found",
        "engine_error: GET /api/tasks/boom => 500 engine exploded",
    ])
    .await;
    stop(s).await;
}

#[tokio::test]
async fn submit_validation() {
    let s = start().await;
    // upstream: runner/internal/shim/api/handlers.go (TaskSubmitHandler: `empty id`,
    // `empty name`, `empty image_name`, in that order). Then values Go's decoder refuses,
    // named by their path as upstream names them (Go 1.27); upstream:
    // runner/internal/common/api/api.go (DecodeJSONBody).
    s.assert_refusals(&[
        r#"no_id: POST /api/tasks {"image_name":"i","name":"n"} => 400 empty id"#,
        r#"no_name: POST /api/tasks {"id":"a","image_name":"i"} => 400 empty name"#,
        r#"no_image_name: POST /api/tasks {"id":"a","name":"n"} => 400 empty image_name"#,
        r#"all_empty: POST /api/tasks {"id":"","image_name":"","name":""} => 400 empty id"#,
        r#"null_name: POST /api/tasks {"id":"a","image_name":"i","name":null} => 400 empty name"#,
        "empty_image_name: POST /api/tasks {\"id\":\"a\",\"image_name\":\"\",\"name\":\"n\"} => \
         400 empty image_name",
        "gpu_below_minus_one: POST /api/tasks \
         {\"gpu\":-2,\"id\":\"a\",\"image_name\":\"i\",\"name\":\"n\"} => \
         400 invalid task config: gpu: must be -1 (all), 0 or a positive count",
        "network_mode_none: POST /api/tasks \
         {\"id\":\"a\",\"image_name\":\"i\",\"name\":\"n\",\"network_mode\":\"none\"} => \
         400 Request body contains an invalid value for the \"network_mode\" field \
         (at position 60): network_mode must be \"host\" or \"bridge\", not \"none\"",
        "id_with_a_leading_dash: POST /api/tasks \
         {\"id\":\"-a\",\"image_name\":\"i\",\"name\":\"n\"} => \
         400 Request body contains an invalid value for the \"id\" field (at position 10): \
         id \"-a\" is invalid: must start with a letter or a digit",
        "gpu_a_string: POST /api/tasks \
         {\"id\": \"a\", \"name\": \"job-1\", \"image_name\": \"i\", \"gpu\": \"x\"} => \
         400 Request body contains an invalid value for the \"gpu\" field (at position 58)",
        "volume_init_fs_a_number: POST /api/tasks \
         {\"id\":\"a\",\"name\":\"n\",\"image_name\":\"i\",\"volumes\":[{\"init_fs\":1}]} => \
         400 Request body contains an invalid value for the \"volumes.0.init_fs\" field \
         (at position 61)",
        // `null` is an empty request to Go's decoder.
        "null: POST /api/tasks null => 400 empty id",
    ])
    .await;
    let submit = async |body: serde_json::Value| s.post("/api/tasks", &body.to_string()).await;
    // A key line that could inject a second line is refused before anything is stored.
    let r = submit(json!({
        "id": "a", "name": "n", "image_name": "i", "container_ssh_keys": [format!("{KEY}\n{KEY}")]
    }))
    .await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("line break"), "{r:?}");
    assert!(s.engine.tasks.lock().unwrap().is_empty());

    // A key with options is accepted as upstream accepts it (the runner gets it as given;
    // a host key like it is skipped at start): upstream runner/internal/shim/docker.go
    // (DockerShellCommands) passes container keys verbatim.
    let r = submit(json!({
        "id": "o", "name": "n", "image_name": "i", "container_ssh_keys": ["command=\"x\" ssh-ed25519 AAAA"],
        "host_ssh_keys": ["garbage"], "host_ssh_user": ""
    }))
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    s.engine.tasks.lock().unwrap().clear();

    // A valid key and null optional fields are fine.
    let r = submit(json!({
        "id": "a", "name": "n", "image_name": "i", "container_ssh_keys": [KEY], "volumes": null
    }))
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(s.engine.tasks.lock().unwrap().len(), 1);
    stop(s).await;
}

/// A task id in a path that is not a valid id names no task: answered as upstream answers
/// an unknown task (it does not validate ids: runner/internal/shim/api/handlers.go), after
/// the body is decoded where upstream decodes it first (terminate).
#[tokio::test]
async fn invalid_ids_in_paths_are_unknown_tasks() {
    let s = start().await;
    s.assert_refusals(&[
        "info_dash: GET /api/tasks/-x => 404 Not Found",
        "info_dots: GET /api/tasks/... => 404 Not Found",
        "info_escaped_slash: GET /api/tasks/a%2Fb => 404 Not Found",
        "info_escaped_space: GET /api/tasks/a%20b => 404 Not Found",
        "terminate: POST /api/tasks/-x/terminate {} => 404 task -x: not found",
        "terminate_bad_body: POST /api/tasks/-x/terminate garbage => \
         400 Request body contains badly-formed JSON (at position 1)",
        "remove: POST /api/tasks/-x/remove => 404 task -x: not found",
        "metrics: GET /metrics/tasks/-x => 404 Task not found",
        // Segments are matched unescaped, as Go's ServeMux matches them; messages name the id so.
        "remove_unescaped: POST /api/tasks/a%20b/remove => 404 task a b: not found",
    ])
    .await;
    assert!(s.engine.terminations.lock().unwrap().is_empty());
    s.post("/api/tasks", &submit_body("t1")).await;
    assert_eq!(s.get("/api/tasks/t%31").await.json()["id"], "t1");
    assert_eq!(s.get("/api/%74asks").await.status, 200);
    let r = s.get("/api/tasks/%zz").await;
    assert_eq!(r.status, 400, "{r:?}");
    stop(s).await;
}

/// Unknown routes and methods as Go's `http.ServeMux` answers them for upstream's patterns
/// (upstream: runner/internal/shim/api/server.go, NewShimServer): `404 page not found`,
/// `Method Not Allowed` with `Allow` (sorted, `HEAD` wherever `GET` is); `HEAD` is served by
/// the `GET` route, without a body.
#[tokio::test]
async fn not_found_and_method_not_allowed() {
    let s = start().await;
    for path in ["/api/nope", "/api/tasks/", "/", "/api/tasks/a/b"] {
        s.get(path).await.assert_error(404, "404 page not found");
    }
    for (method, path, allow) in [
        ("DELETE", "/api/tasks", "GET, HEAD, POST"),
        ("GET", "/api/tasks/a/terminate", "POST"),
        ("POST", "/api/healthcheck", "GET, HEAD"),
        ("PUT", "/metrics/tasks/a", "GET, HEAD"),
        ("OPTIONS", "/api/tasks", "GET, HEAD, POST"),
    ] {
        let r = s.bare(method, path).await;
        r.assert_error(405, "Method Not Allowed");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
    let r = s.bare("HEAD", "/api/healthcheck").await;
    r.assert_answer(200, Some("application/json"), "");
    stop(s).await;
}

/// A path that is not canonical is redirected to the clean one, as Go's `http.ServeMux`
/// (Go 1.22 and later) does before it routes: `307` with `Location`, Go's HTML body for `GET`
/// (upstream: runner/internal/shim/api/server.go serves a plain ServeMux).
#[tokio::test]
async fn unclean_paths_are_redirected_as_go_does() {
    let s = start().await;
    let r = s.get("/api//tasks").await;
    let (html, body) = (
        Some("text/html; charset=utf-8"),
        "<a href=\"/api/tasks\">Temporary Redirect</a>.\n\n",
    );
    r.assert_answer(307, html, body);
    assert_eq!(r.header("location"), Some("/api/tasks"));
    let r = s.get("/api/tasks/./t1?x=1&y=2").await;
    assert_eq!(r.header("location"), Some("/api/tasks/t1?x=1&y=2"));
    let body = "<a href=\"/api/tasks/t1?x=1&amp;y=2\">Temporary Redirect</a>.\n\n";
    assert_eq!(r.body, body);
    let r = s.get("/api/tasks/..").await;
    assert_eq!((r.status, r.header("location")), (307, Some("/api")));
    // POST keeps its method through a 307: no type, no body.
    let r = s.post("//api/shutdown", "{}").await;
    r.assert_answer(307, None, "");
    assert_eq!(r.header("location"), Some("/api/shutdown"));
    assert!(!s.shutdown.is_cancelled(), "nothing was served");
    stop(s).await;
}

/// The whole answer, as upstream's server writes it byte for byte (Go 1.27 serving upstream's
/// handlers; the Date header aside): header names capitalized as Go writes them,
/// `Content-Length`, the newline after JSON and after a message; the healthcheck's and the
/// instance routes' JSON. upstream: runner/internal/common/api/api.go (JSONResponseHandler).
#[tokio::test]
async fn answers_are_upstreams_byte_for_byte() {
    let s = start().await;
    let json = ["HTTP/1.1 200 OK", "Content-Type: application/json"];
    let health = r#"{"service":"dstack-shim","version":"0.22.0"}"#;
    for (path, body) in [
        ("/api/healthcheck", health),
        ("/api/instance/info", r#"{"gpu_vendor":"nvidia"}"#),
        ("/api/instance/health", r#"{"dcgm":null}"#),
    ] {
        assert_whole_answer(&s.get(path).await, &json, body);
    }
    let text = "Content-Type: text/plain; charset=utf-8";
    let nosniff = "X-Content-Type-Options: nosniff";
    let r = s.bare("DELETE", "/api/tasks").await;
    let allow = "Allow: GET, HEAD, POST";
    let head = ["HTTP/1.1 405 Method Not Allowed", allow, text, nosniff];
    assert_whole_answer(&r, &head, "Method Not Allowed");
    let r = s.post("/api/shutdown", r#"{"force": "yes"}"#).await;
    let message = "Request body contains an invalid value for the \"force\" field (at position 15)";
    assert_whole_answer(&r, &["HTTP/1.1 400 Bad Request", text, nosniff], message);
    // Go's encoder escapes <, >, & and U+2028/9 in strings.
    s.post("/api/tasks", &submit_body("esc")).await;
    let message = "{\"termination_message\":\"a<b>&c\u{2028}\"}";
    let r = s.post("/api/tasks/esc/terminate", message).await;
    let escaped = r#""termination_message":"a\u003cb\u003e\u0026c\u2028""#;
    assert!(r.body.contains(escaped), "{r:?}");
    stop(s).await;
}

/// Asserts the answer byte for byte but for its Date header: the status line and the header
/// lines of `head` (in any order) with `Content-Length` and `Connection: close`, then `line`
/// and a newline (every answer here is one line).
#[track_caller]
fn assert_whole_answer(r: &Resp, head: &[&str], line: &str) {
    let (got_head, got_body) = r.raw.split_once("\r\n\r\n").unwrap();
    let mut got: Vec<&str> = got_head
        .split("\r\n")
        .filter(|l| !l.starts_with("Date: "))
        .collect();
    got.sort_unstable();
    let body = format!("{line}\n");
    let length = format!("Content-Length: {}", body.len());
    let mut want = [head, &[&length, "Connection: close"]].concat();
    want.sort_unstable();
    assert_eq!((got, got_body), (want, body.as_str()), "{r:?}");
}

/// Request bodies as upstream's decoder takes them, with its messages.
///
/// upstream: runner/internal/common/api/api.go (DecodeJSONBody: gddo's
/// `header.ParseValueAndParams` for the content type, a 1 MiB `MaxBytesReader`).
#[tokio::test]
async fn body_rules() {
    let s = start().await;
    // 415
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/jsonx",
    ] {
        let r = s.send("/api/shutdown", Some(ct), Some(b"{}")).await;
        r.assert_error(415, "Content-Type header is not application/json");
    }
    // Parameters, other cases and what follows the media type are fine; so is a missing or
    // empty Content-Type.
    for (i, ct) in [
        Some("application/json; charset=utf-8"),
        Some("Application/JSON"),
        Some("application/json, text/plain"),
        Some(""),
        None,
    ]
    .into_iter()
    .enumerate()
    {
        let body = submit_body(&format!("ct{i}"));
        let r = s.send("/api/tasks", ct, Some(body.as_bytes())).await;
        assert_eq!(r.status, 200, "{ct:?}: {r:?}");
    }

    // 400
    let (terminate, json) = ("/api/tasks/ct0/terminate", Some("application/json"));
    for body in [Some(&b""[..]), None] {
        let r = s.send(terminate, json, body).await;
        r.assert_error(400, "Request body must not be empty");
    }
    let r = s.post(terminate, "{\"timeout\": ").await;
    r.assert_error(400, "Request body contains badly-formed JSON");
    s.assert_refusals(&[
        "an_array: POST /api/tasks/ct0/terminate [] => \
         400 Request body contains an invalid value for the \"\" field (at position 1)",
        "two_objects: POST /api/tasks/ct0/terminate {} {} => \
         400 Request body must only contain a single JSON object",
        "not_json: POST /api/tasks/ct0/terminate {\"timeout\": x} => \
         400 Request body contains badly-formed JSON (at position 13)",
        "a_negative_timeout: POST /api/tasks/ct0/terminate {\"timeout\": -1} => \
         400 Request body contains an invalid value for the \"timeout\" field (at position 14)",
    ])
    .await;
    // `null` is an empty request.
    assert_eq!(s.post(terminate, "null").await.status, 200);

    // 413 announced by Content-Length: answered without reading the body.
    let big = (shim_http::MAX_BODY_BYTES + 1).to_string();
    let headers = [
        ("Content-Type", "application/json"),
        ("Content-Length", &big),
    ];
    let r = raw(s.addr, "POST", "/api/tasks", &headers, None).await;
    r.assert_error(413, "Request body must not be larger than 1MB");

    // Exactly the limit is accepted (and then judged as JSON).
    let mut at_limit = b"{\"termination_message\":\"".to_vec();
    at_limit.resize(shim_http::MAX_BODY_BYTES - 2, b'x');
    at_limit.extend_from_slice(b"\"}");
    assert_eq!(at_limit.len(), shim_http::MAX_BODY_BYTES);
    let r = s.send(terminate, json, Some(&at_limit)).await;
    assert_eq!(r.status, 200, "{}", r.body);

    // 413 discovered while streaming (chunked, no Content-Length). The chunks stop right past
    // the limit without a final chunk, so the server has read everything the client sent.
    let mut req = b"POST /api/tasks HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
        Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    let chunk = vec![b' '; 64 * 1024];
    for _ in 0..(shim_http::MAX_BODY_BYTES / chunk.len()) {
        req.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        req.extend_from_slice(&chunk);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"1\r\n \r\n");
    let stream = TcpStream::connect(s.addr).await.unwrap();
    let r = tokio::time::timeout(BOUND, exchange(stream, &req))
        .await
        .unwrap();
    r.assert_error(413, "Request body must not be larger than 1MB");
    stop(s).await;
}

#[tokio::test]
async fn metrics_route() {
    let s = start().await;
    // Upstream writes the text with no Content-Type: Go sniffs plain text, and sends none
    // for an empty body (upstream: runner/internal/shim/api/handlers.go, TaskMetricsHandler).
    s.get("/metrics/tasks/metrics-ok").await.assert_answer(
        200,
        Some("text/plain; charset=utf-8"),
        "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} 42\n",
    );
    let r = s.get("/metrics/tasks/metrics-empty").await;
    r.assert_answer(200, None, "");
    assert_eq!(r.header("content-length"), Some("0"));
    // Upstream (same handler): an unknown task is "Task not found"; without an exporter every
    // request is "DCGM Exporter is not available", checked before the task.
    s.assert_refusals(&[
        "exporter_error: GET /metrics/tasks/metrics-bad => 502 exporter: connection refused",
        "unknown_task: GET /metrics/tasks/t => 404 Task not found",
    ])
    .await;
    s.engine.no_exporter.store(true, Ordering::SeqCst);
    s.assert_refusals(&[
        "no_exporter: GET /metrics/tasks/metrics-ok => 404 DCGM Exporter is not available",
        "no_exporter_bad_id: GET /metrics/tasks/-x => 404 DCGM Exporter is not available",
    ])
    .await;
    stop(s).await;
}

/// The components routes' answers, including the refusals of an install request.
///
/// upstream: runner/internal/shim/api/handlers.go (ComponentInstallHandler).
#[tokio::test]
async fn component_routes() {
    let s = start().await;
    let v = s.get("/api/components").await.json();
    assert_eq!(
        v,
        json!({"components": [
            {"name": "dstack-runner", "version": "1.2.3", "status": "installed"},
            {"name": "dstack-shim", "version": "", "status": "installing"},
        ]})
    );
    s.assert_refusals(&[
        "empty_name: POST /api/components/install {\"name\":\"\",\"url\":\"http://x/y\"} => \
         400 empty name",
        r#"no_name: POST /api/components/install {"url":"http://x/y"} => 400 empty name"#,
        "unknown_component: POST /api/components/install \
         {\"name\":\"dstack-gateway\",\"url\":\"http://x/y\"} => 400 unknown component",
        "empty_url: POST /api/components/install {\"name\":\"dstack-runner\",\"url\":\"\"} => \
         400 empty url",
        "while_installing: POST /api/components/install \
         {\"name\":\"dstack-shim\",\"url\":\"http://x/y\"} => 409 already installing",
    ])
    .await;
    let install = r#"{"name":"dstack-runner","url":"http://x/y"}"#;
    let r = s.post("/api/components/install", install).await;
    r.assert_empty_ok();
    assert_eq!(
        *s.components.installs.lock().unwrap(),
        vec![(ComponentName::Runner, "http://x/y".to_owned())]
    );
    stop(s).await;
}

#[tokio::test]
async fn fifty_parallel_requests() {
    let s = start().await;
    let mut joins = Vec::new();
    for i in 0..50 {
        let addr = s.addr;
        joins.push(tokio::spawn(async move {
            let id = format!("p{i}");
            let r = post(addr, "/api/tasks", &submit_body(&id)).await;
            assert_eq!(r.status, 200, "{r:?}");
            let r = get(addr, &format!("/api/tasks/{id}")).await;
            assert_eq!(r.json()["id"], id.as_str());
        }));
    }
    for j in joins {
        j.await.unwrap();
    }
    let v = s.get("/api/tasks").await.json();
    assert_eq!(v["tasks"].as_array().unwrap().len(), 50);
    stop(s).await;
}

// ---------------------------------------------------------------------------------------------
// Sockets.

/// What binding `tcp` (and `unix`, if given) fails with.
async fn bind_error(tcp: &str, unix: Option<&Path>) -> HttpError {
    let bound = Listeners::bind(tcp.parse().unwrap(), unix).await;
    bound.expect_err("binding fails")
}

#[tokio::test]
async fn refuses_non_loopback() {
    let e = bind_error("0.0.0.0:0", None).await;
    assert!(matches!(e, HttpError::NotLoopback { .. }), "{e}");
    let message = "refusing to listen on 0.0.0.0:0: the shim API is loopback-only";
    assert_eq!(e.to_string(), message);
    let e = bind_error("192.0.2.1:0", None).await;
    assert!(matches!(e, HttpError::NotLoopback { .. }), "{e}");
}

#[tokio::test]
async fn unix_socket_mode_0600_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shim.sock");
    // A stale socket (nobody listens) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let meta = || fs_err::symlink_metadata(&path).unwrap();
    assert!(meta().file_type().is_socket());

    let s = start_server(Some(&path), |c| c).await;
    assert!(meta().file_type().is_socket());
    assert_eq!(meta().permissions().mode() & 0o777, 0o600);
    // No temporary file left beside it.
    let names: Vec<_> = fs_err::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("shim.sock")]);

    let stream = UnixStream::connect(&path).await.unwrap();
    let r = exchange(stream, &request_bytes("GET", "/api/healthcheck", &[], None)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["version"], "0.22.0");

    // A live socket is not stolen.
    let e = bind_error("127.0.0.1:0", Some(&path)).await;
    assert!(matches!(e, HttpError::SocketInUse { .. }), "{e}");

    stop(s).await;
    assert!(!path.exists(), "the socket is removed on shutdown");

    // Something that is not a socket is never replaced.
    fs_err::write(&path, "precious").unwrap();
    let e = bind_error("127.0.0.1:0", Some(&path)).await;
    assert!(matches!(e, HttpError::NotASocket { .. }), "{e}");
    assert_eq!(fs_err::read_to_string(&path).unwrap(), "precious");
}

// ---------------------------------------------------------------------------------------------
// Shutdown.

/// The test's ends of a drain hook: `started` fires when the server awaits the hook,
/// `release` ends it (as does dropping it).
struct DrainCtl {
    started: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
}

impl DrainCtl {
    /// Waits until the server awaits the drain hook, checks that the hook holds the server,
    /// then ends the hook and waits for `serve` to return.
    async fn release_once_it_holds(self, handle: JoinHandle<Result<(), HttpError>>) {
        tokio::time::timeout(BOUND, self.started)
            .await
            .expect("the server awaits the drain hook")
            .unwrap();
        assert!(!handle.is_finished(), "the drain future holds the server");
        self.release.send(()).unwrap();
        serve_returns(handle).await;
    }
}

/// A server with a drain hook the test controls, and the settings `configure` adds.
async fn start_draining(
    configure: impl FnOnce(ServerConfig) -> ServerConfig,
) -> (Server, DrainCtl) {
    let (started_tx, started) = oneshot::channel();
    let (release, release_rx) = oneshot::channel::<()>();
    let hook = async move {
        let _ = started_tx.send(());
        let _ = release_rx.await;
    };
    let s = start_server(None, |c| configure(c.with_drain(hook))).await;
    (s, DrainCtl { started, release })
}

/// Starts `GET /api/tasks/slow` and waits until the engine holds it; the handle gives what
/// it got before its connection closed.
async fn start_slow_request(s: &Server) -> JoinHandle<Vec<u8>> {
    let addr = s.addr;
    let join = tokio::spawn(async move {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = request_bytes("GET", "/api/tasks/slow", &[], None);
        stream.write_all(&request).await.unwrap();
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw).await;
        raw
    });
    tokio::time::timeout(BOUND, s.engine.entered.notified())
        .await
        .expect("the slow request reaches the engine");
    join
}

/// What the slow request got before its connection closed (bounded).
async fn slow_answer(slow: JoinHandle<Vec<u8>>) -> Vec<u8> {
    tokio::time::timeout(BOUND, slow).await.unwrap().unwrap()
}

async fn assert_slow_unanswered(slow: JoinHandle<Vec<u8>>) {
    let raw = slow_answer(slow).await;
    assert!(
        raw.is_empty(),
        "the in-flight request got an answer: {raw:?}"
    );
}

/// Waits (bounded) until connecting to `addr` is refused.
async fn until_refused(addr: SocketAddr) {
    tokio::time::timeout(BOUND, async {
        while TcpStream::connect(addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the listener closes");
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_requests_then_drains() {
    let (s, ctl) = start_draining(|c| c).await;
    let slow = start_slow_request(&s).await;
    s.shutdown.cancel();
    until_refused(s.addr).await;
    let held = "an in-flight request holds the server";
    assert!(!s.handle.is_finished(), "{held}");

    s.engine.release.notify_one();
    let r = parse_response(&slow_answer(slow).await);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "running");
    // Requests drained; now the server waits for the background jobs.
    ctl.release_once_it_holds(s.handle).await;
}

/// A request still in flight when the request drain timeout passes (a terminate waiting for
/// a long stop) holds a graceful shutdown no longer: its connection is closed unanswered and
/// the shutdown goes on to the background jobs. Upstream bounds its shutdown likewise
/// (runner/cmd/shim/main.go: `Shutdown` with a 5 s context).
#[tokio::test]
async fn a_request_in_flight_holds_a_graceful_shutdown_no_longer_than_the_drain_timeout() {
    let timeout = Duration::from_millis(300);
    let (s, ctl) = start_draining(|c| c.with_request_drain_timeout(timeout)).await;
    let slow = start_slow_request(&s).await;
    s.shutdown.cancel();
    until_refused(s.addr).await;
    ctl.release_once_it_holds(s.handle).await;
    assert_slow_unanswered(slow).await;
}

/// A connection accepted just before a graceful shutdown whose request comes just after it
/// (through the dstack server's SSH tunnel a request follows the accept by a round trip) is
/// still answered: hyper alone closes a connection that has received nothing at once, as
/// Go's server does only after 5 s.
#[tokio::test]
async fn a_request_just_after_its_connection_and_a_graceful_shutdown_is_answered() {
    let s = start().await;
    let mut fresh = TcpStream::connect(s.addr).await.unwrap();
    // Accepted: the listener takes connections in order, and a later one was answered.
    assert_eq!(s.get("/api/healthcheck").await.status, 200);
    s.shutdown.cancel();
    // The shutdown has reached the server (its listener is closed), and so the connection.
    until_refused(s.addr).await;
    let request = b"GET /api/healthcheck HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    fresh.write_all(request).await.unwrap();
    let answer = String::from_utf8_lossy(&until_closed(&mut fresh).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    serve_returns(s.handle).await;
}

#[tokio::test]
async fn forced_shutdown_closes_at_once() {
    let (s, _ctl) = start_draining(|c| c).await;
    let slow = start_slow_request(&s).await;
    s.force.cancel();
    // serve returns although a request is in flight and the drain never completes.
    serve_returns(s.handle).await;
    assert_slow_unanswered(slow).await;
    assert!(TcpStream::connect(s.addr).await.is_err());
}

#[tokio::test]
async fn forced_shutdown_interrupts_a_graceful_one() {
    let (s, _ctl) = start_draining(|c| c).await;
    let slow = start_slow_request(&s).await;
    s.shutdown.cancel();
    until_refused(s.addr).await;
    s.force.cancel();
    serve_returns(s.handle).await;
    assert_slow_unanswered(slow).await;
}

#[tokio::test]
async fn shutdown_endpoint_graceful() {
    let (s, ctl) = start_draining(|c| c).await;
    let r = s.post("/api/shutdown", r#"{"force":false}"#).await;
    r.assert_empty_ok();
    until_refused(s.addr).await;
    assert!(s.shutdown.is_cancelled());
    assert!(!s.force.is_cancelled());
    ctl.release_once_it_holds(s.handle).await;
}

#[tokio::test]
async fn shutdown_endpoint_force() {
    let (s, _ctl) = start_draining(|c| c).await;
    let slow = start_slow_request(&s).await;
    let r = s.post("/api/shutdown", r#"{"force":true}"#).await;
    r.assert_empty_ok();
    serve_returns(s.handle).await;
    assert!(s.force.is_cancelled());
    assert_slow_unanswered(slow).await;
}

// ---------------------------------------------------------------------------------------------
// Connection limits: stalled, idle and oversized clients cannot make the API unreachable.

/// Short timeouts for the tests (the defaults are tens of seconds).
fn short_limits() -> ConnectionLimits {
    ConnectionLimits {
        header_read_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_millis(300),
        ..ConnectionLimits::default()
    }
}

/// A healthcheck without `Connection: close`: the connection stays open after the answer.
const KEEP_ALIVE_HEALTHCHECK: &[u8] = b"GET /api/healthcheck HTTP/1.1\r\nHost: x\r\n\r\n";

/// Sends [`KEEP_ALIVE_HEALTHCHECK`] on `stream` and reads its answer (bounded; one read).
async fn healthcheck_on(stream: &mut TcpStream) -> Resp {
    stream.write_all(KEEP_ALIVE_HEALTHCHECK).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let read = tokio::time::timeout(BOUND, stream.read(&mut buf)).await;
    parse_response(&buf[..read.unwrap().unwrap()])
}

/// Reads until the server closes the connection (EOF or reset), bounded; returns what came.
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    let read = tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server did not close the connection");
    raw
}

/// Asserts that the server closes the connection without sending anything.
async fn assert_closed_unanswered(stream: &mut TcpStream) {
    let raw = until_closed(stream).await;
    assert!(raw.is_empty(), "{:?}", String::from_utf8_lossy(&raw));
}

/// Opens `n` connections that stall: every other one sends nothing, the rest half a request
/// head (no blank line ends it).
async fn stalled_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut stalled = Vec::with_capacity(n);
    for i in 0..n {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        if i % 2 == 1 {
            let half = b"GET /api/healthcheck HTTP/1.1\r\nHost: x\r\nX-Half: ";
            stream.write_all(half).await.unwrap();
        }
        stalled.push(stream);
    }
    stalled
}

/// 300 stalled connections, more than the cap of 100: a normal client is still answered (the
/// longest-idle connections make room), and every stalled connection is closed, by eviction or
/// by the timeouts, without an answer.
#[tokio::test]
async fn stalled_connections_do_not_lock_out_a_normal_client() {
    let limits = ConnectionLimits {
        max_connections: 100,
        ..short_limits()
    };
    let s = start_limited(limits).await;
    let mut stalled = stalled_connections(s.addr, 300).await;
    let r = s.get("/api/healthcheck").await;
    assert_eq!(r.status, 200, "{r:?}");
    let r = s.get("/api/tasks").await;
    assert_eq!(r.status, 200, "{r:?}");
    for stream in &mut stalled {
        assert_closed_unanswered(stream).await;
    }
    stop(s).await;
}

/// Under the cap, the timeouts close stalled connections: one that sends nothing and one that
/// sent half a head (idle timeout), and one that trickles its head a byte at a time so it is
/// never idle (header read timeout). A client that keeps to the rules is answered meanwhile.
#[tokio::test]
async fn stalled_connections_are_closed_after_the_timeouts() {
    let s = start_limited(short_limits()).await;
    let mut stalled = stalled_connections(s.addr, 2).await;

    let mut trickler = TcpStream::connect(s.addr).await.unwrap();
    let head = b"GET /api/healthcheck HTTP/1.1\r\nHost: x\r\nX-Slow: ".to_vec();
    let trickled = tokio::time::timeout(BOUND, async {
        // A byte every 100 ms (well under the idle timeout), forever: only the header read
        // timeout ends it, with a write error or EOF.
        for byte in head.iter().copied().chain(std::iter::repeat(b'a')) {
            if trickler.write_all(&[byte]).await.is_err() {
                return;
            }
            let mut probe = [0u8; 1];
            let wait = Duration::from_millis(100);
            match tokio::time::timeout(wait, trickler.read(&mut probe)).await {
                Ok(Ok(0) | Err(_)) => return,
                Ok(Ok(_)) => panic!("the trickling client got an answer"),
                Err(_) => {}
            }
        }
    })
    .await;
    assert!(trickled.is_ok(), "the trickling client was never cut off");

    assert_eq!(s.get("/api/healthcheck").await.status, 200);
    for stream in &mut stalled {
        assert_closed_unanswered(stream).await;
    }
    stop(s).await;
}

/// A request whose body stalls (its head complete, its body never) is answered 408 and its
/// connection closed once the body read timeout passes, so it holds neither the only
/// connection the cap allows (a request in progress is never idle, nor evicted) nor a
/// graceful shutdown. hyper times out request heads only. A departure from upstream, whose Go
/// server sets no timeout (upstream: runner/internal/shim/api/server.go, `http.Server` with
/// none of its timeouts): it would hold such a connection for ever.
#[tokio::test]
async fn a_stalled_body_is_answered_408_and_holds_nothing() {
    let limits = ConnectionLimits {
        max_connections: 1,
        body_read_timeout: Duration::from_millis(500),
        ..short_limits()
    };
    let s = start_limited(limits).await;
    let mut stalled = TcpStream::connect(s.addr).await.unwrap();
    let head = "POST /api/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 10\r\n\r\n{";
    stalled.write_all(head.as_bytes()).await.unwrap();
    let r = parse_response(&until_closed(&mut stalled).await);
    assert_eq!(r.status, 408, "{r:?}");
    assert_eq!(s.get("/api/healthcheck").await.status, 200);
    stop(s).await;
}

/// A keep-alive connection is served several times, then closed once idle.
#[tokio::test]
async fn idle_keep_alive_connections_are_closed() {
    let limits = ConnectionLimits {
        header_read_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_millis(300),
        ..ConnectionLimits::default()
    };
    let s = start_limited(limits).await;
    let mut stream = TcpStream::connect(s.addr).await.unwrap();
    for _ in 0..2 {
        assert_eq!(healthcheck_on(&mut stream).await.status, 200);
    }
    // Nothing more is sent: the server closes the connection (the header read timeout is a
    // minute, so the idle timeout is what closes it).
    assert_closed_unanswered(&mut stream).await;
    stop(s).await;
}

/// A request head over the limit is answered 431 and the connection closed; one under it is
/// served.
#[tokio::test]
async fn oversized_headers_are_refused() {
    let s = start().await;
    let max = ConnectionLimits::default().max_header_bytes;
    let under = "a".repeat(max / 2);
    let r = raw(
        s.addr,
        "GET",
        "/api/healthcheck",
        &[("X-Big", &under)],
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");

    let over = "a".repeat(max + 1);
    let mut stream = TcpStream::connect(s.addr).await.unwrap();
    let request = request_bytes("GET", "/api/healthcheck", &[("X-Big", &over)], None);
    stream.write_all(&request).await.unwrap();
    let r = parse_response(&until_closed(&mut stream).await);
    assert_eq!(r.status, 431, "{r:?}");
    stop(s).await;
}

/// At the cap with every connection busy (a request in progress), a new connection is
/// closed at once without an answer; once the request finished, new connections are served.
#[tokio::test]
async fn at_the_cap_with_every_connection_busy_a_new_one_is_closed() {
    let limits = ConnectionLimits {
        max_connections: 1,
        ..ConnectionLimits::default()
    };
    let s = start_limited(limits).await;
    let slow = start_slow_request(&s).await;

    let mut refused = TcpStream::connect(s.addr).await.unwrap();
    let _ = refused.write_all(KEEP_ALIVE_HEALTHCHECK).await;
    assert_closed_unanswered(&mut refused).await;

    s.engine.release.notify_one();
    assert_eq!(parse_response(&slow_answer(slow).await).status, 200);
    // The slow connection's task ends soon after its answer (bounded retries, not a timing
    // assertion): then a new client is served.
    let served = tokio::time::timeout(BOUND, async {
        loop {
            let Ok(mut stream) = TcpStream::connect(s.addr).await else {
                continue;
            };
            let request = request_bytes("GET", "/api/healthcheck", &[], None);
            if stream.write_all(&request).await.is_err() {
                continue;
            }
            let mut raw = Vec::new();
            let _ = stream.read_to_end(&mut raw).await;
            if !raw.is_empty() {
                return parse_response(&raw).status;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a new connection is served once the busy one is done");
    assert_eq!(served, 200);
    stop(s).await;
}

// ---------------------------------------------------------------------------------------------
// Handing the listening socket over (an upgrade in place, socket activation).

/// A shutdown hook decides instead of the server (here: shut down); a duplicate of the
/// listening socket kept across `serve`'s end keeps accepting connections into the backlog,
/// and a second server on that socket (`Listeners::from_tcp`) answers the request that waited
/// there: nothing is refused in between.
#[tokio::test]
async fn the_listening_socket_is_handed_to_the_next_server() {
    let listeners = Listeners::bind("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let addr = listeners.tcp_addr();
    let kept = listeners.tcp_fd().try_clone_to_owned().unwrap();
    let (shutdown, force) = (CancellationToken::new(), CancellationToken::new());
    let asked = Arc::new(Mutex::new(Vec::new()));
    let hook = {
        let (asked, shutdown) = (asked.clone(), shutdown.clone());
        Arc::new(move |request: shim_http::ShutdownRequest| {
            asked.lock().unwrap().push(request.force);
            shutdown.cancel();
        })
    };
    let config = ServerConfig::new("0.22.0")
        .with_force_shutdown(force.clone())
        .with_shutdown_hook(hook);
    let serve_on = |listeners, config, shutdown| {
        let (engine, components) = (FakeEngine::default(), FakeComponents::default());
        tokio::spawn(serve(
            listeners,
            Arc::new(engine),
            Arc::new(components),
            config,
            shutdown,
        ))
    };
    let first = serve_on(listeners, config, shutdown.clone());
    let r = post(addr, "/api/shutdown", r#"{"force":false}"#).await;
    assert_eq!((r.status, r.body.as_str()), (200, "\n"));
    serve_returns(first).await;
    assert_eq!(*asked.lock().unwrap(), [false]);
    assert!(!force.is_cancelled(), "the hook did not force");

    // Nobody serves the port now, yet a client connects and sends its request.
    let mut waiting = TcpStream::connect(addr).await.unwrap();
    let request = request_bytes("GET", "/api/healthcheck", &[], None);
    waiting.write_all(&request).await.unwrap();

    let listeners = Listeners::from_tcp(std::net::TcpListener::from(kept), None).unwrap();
    assert_eq!(listeners.tcp_addr(), addr);
    let shutdown = CancellationToken::new();
    let second = serve_on(listeners, ServerConfig::new("0.22.1"), shutdown.clone());
    let mut answer = Vec::new();
    let read = tokio::time::timeout(BOUND, waiting.read_to_end(&mut answer)).await;
    read.unwrap().unwrap();
    let answer = parse_response(&answer);
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["version"], "0.22.1");
    shutdown.cancel();
    serve_returns(second).await;
}

/// A socket that is not on a loopback address is refused, whoever made it.
#[tokio::test]
async fn an_inherited_socket_must_be_loopback() {
    let socket = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = socket.local_addr().unwrap().port();
    let e = Listeners::from_tcp(socket, None).unwrap_err();
    assert!(matches!(e, HttpError::NotLoopback { .. }), "{e}");
    let message = format!("refusing to listen on 0.0.0.0:{port}: the shim API is loopback-only");
    assert_eq!(e.to_string(), message);
}
