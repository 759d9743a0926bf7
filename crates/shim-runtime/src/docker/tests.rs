//! [`DockerRuntime`] against a scripted engine: a Unix socket answering HTTP/1.1 with the
//! fixtures of what Docker and Podman send, so that their answers go through bollard and this
//! runtime as a real engine's would, and the requests the runtime makes can be checked.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::Docker;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{DockerRuntime, Flavour};
use crate::spec::{BindMount, ContainerSpec, DeviceMapping, DeviceRequest};
use crate::types::{ContainerState, EventKind, PullRequest};
use crate::{ContainerRuntime, RuntimeError};
use shim_e2e::assert_matches;
use shim_task::PullProgress;

/// A status and a body.
type Answer = (u16, String);

/// What the engine answers to a method and a request target (the API version prefix taken
/// off, percent-decoded); `None`: 404.
trait Script: Fn(&str, &str) -> Option<Answer> + Send + Sync + 'static {}

impl<F: Fn(&str, &str) -> Option<Answer> + Send + Sync + 'static> Script for F {}

/// A version answer without components: Docker's shape (the engine is told by the
/// components; Docker's name one "Engine").
const VERSION: &str =
    r#"{"Version":"4.3.1","ApiVersion":"1.41","MinAPIVersion":"1.24","Os":"linux","Arch":"amd64"}"#;

/// Podman 5.4.2's version answer, in the shape of its compat handler
/// (pkg/api/handlers/compat/version.go), details trimmed.
const VERSION_PODMAN_5_4: &str = r#"{"Platform":{"Name":"linux/amd64/debian-13"},"Components":[{"Name":"Podman Engine","Version":"5.4.2","Details":{"APIVersion":"5.4.2","Arch":"amd64","MinAPIVersion":"4.0.0","Os":"linux"}},{"Name":"Conmon","Version":"conmon version 2.1.12, commit: unknown","Details":{"Package":"conmon_2.1.12-4_amd64"}},{"Name":"OCI Runtime (crun)","Version":"crun version 1.21","Details":{"Package":"crun_1.21-1_amd64"}}],"Version":"5.4.2","ApiVersion":"1.41","MinAPIVersion":"1.24","Os":"linux","Arch":"amd64"}"#;

/// A request the engine received: `METHOD target` and its body.
type Request = (String, String);

struct Engine {
    socket: PathBuf,
    requests: Arc<Mutex<Vec<Request>>>,
    /// What `/version` answers.
    version: Arc<Mutex<&'static str>>,
    _dir: tempfile::TempDir,
}

impl Engine {
    /// An engine answering `/version` with `version` (Docker's: [`VERSION`]), and the rest as
    /// `script` says.
    fn start(version: &'static str, script: impl Script) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("engine.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let script: Arc<dyn Script> = Arc::new(script);
        let (seen, version) = (requests.clone(), Arc::new(Mutex::new(version)));
        let answered = version.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let (script, seen, version) = (script.clone(), seen.clone(), answered.clone());
                std::thread::spawn(move || {
                    // An error ends this connection only.
                    let _ = serve(conn, &version, &*script, &seen);
                });
            }
        });
        Self {
            socket,
            requests,
            version,
            _dir: dir,
        }
    }

    /// The engine is upgraded: `/version` answers `version` from now on.
    fn set_version(&self, version: &'static str) {
        *self.version.lock().unwrap() = version;
    }

    /// An engine as [`Engine::start`] starts it, and a runtime connected to it.
    async fn connect(version: &'static str, script: impl Script) -> (Self, DockerRuntime) {
        let engine = Self::start(version, script);
        let runtime = DockerRuntime::from_client(engine.client()).await.unwrap();
        (engine, runtime)
    }

    /// A client of this engine.
    fn client(&self) -> Docker {
        let socket = self.socket.to_str().unwrap();
        Docker::connect_with_unix(socket, 5, bollard::API_DEFAULT_VERSION).unwrap()
    }

    /// Every request so far, as `METHOD target`.
    fn requests(&self) -> Vec<String> {
        let requests = self.requests.lock().unwrap();
        requests.iter().map(|(line, _)| line.clone()).collect()
    }

    /// Fails the test if a request so far names `path`.
    #[track_caller]
    fn assert_never_asked(&self, path: &str) {
        let requests = self.requests();
        assert!(!requests.iter().any(|r| r.contains(path)), "{requests:?}");
    }

    /// The one request whose path starts with `path`.
    fn one_request(&self, path: &str) -> Request {
        let requests = self.requests.lock().unwrap();
        let matching: Vec<_> = requests
            .iter()
            .filter(|(line, _)| target(line).starts_with(path))
            .collect();
        assert_eq!(matching.len(), 1, "{requests:?}");
        matching[0].clone()
    }

    /// The body of the one request whose path starts with `path`, as JSON.
    fn body(&self, path: &str) -> serde_json::Value {
        serde_json::from_str(&self.one_request(path).1).unwrap()
    }

    /// The `filters` query parameter of the one request whose path starts with `path`.
    fn filters(&self, path: &str) -> HashMap<String, Vec<String>> {
        let (line, _) = self.one_request(path);
        let query = line.split_once('?').map_or("", |(_, q)| q);
        let filters = query
            .split('&')
            .find_map(|p| p.strip_prefix("filters="))
            .unwrap_or("{}");
        serde_json::from_str(filters).unwrap()
    }
}

/// The target of a request line `METHOD target`.
fn target(line: &str) -> &str {
    line.split(' ').nth(1).unwrap_or_default()
}

/// A script answering `status` and `body` to `method` requests whose target starts with
/// `prefix` (404 to the rest).
fn answering(
    method: &'static str,
    prefix: &'static str,
    status: u16,
    body: impl Into<String>,
) -> impl Script {
    let body = body.into();
    move |m, target| (m == method && target.starts_with(prefix)).then(|| (status, body.clone()))
}

/// An engine that creates every container it is asked to, as `c0ffee`.
fn creating() -> impl Script {
    let created = r#"{"Id":"c0ffee","Warnings":[]}"#;
    answering("POST", "/containers/create", 201, created)
}

fn serve(
    conn: UnixStream,
    version: &Mutex<&'static str>,
    script: &dyn Script,
    seen: &Mutex<Vec<Request>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let target = decode(parts.next().unwrap_or_default());
    let mut length = 0;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header)?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    // `/v1.41/containers/json` → `/containers/json`.
    let target = match target.strip_prefix("/v") {
        Some(rest) => rest
            .find('/')
            .map_or(target.clone(), |i| rest[i..].to_owned()),
        None => target,
    };
    seen.lock().unwrap().push((
        format!("{method} {target}"),
        String::from_utf8_lossy(&body).into_owned(),
    ));
    let path = target.split('?').next().unwrap_or_default();
    let (status, body) = match path {
        "/version" => (200, (*version.lock().unwrap()).to_owned()),
        "/_ping" => (200, "OK".to_owned()),
        _ => script(&method, &target)
            .unwrap_or_else(|| (404, r#"{"message":"no such route"}"#.to_owned())),
    };
    // No length: the body ends with the connection, as a stream's does. A line `#sleep MS`
    // of the body is a pause of the engine's (a stream that goes silent), not sent.
    let mut out = conn;
    write!(
        out,
        "HTTP/1.1 {status} Scripted\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    )?;
    for line in body.split_inclusive('\n') {
        match line.trim_end().strip_prefix("#sleep ") {
            Some(ms) => {
                out.flush()?;
                std::thread::sleep(Duration::from_millis(ms.parse().unwrap_or(0)));
            }
            None => out.write_all(line.as_bytes())?,
        }
    }
    out.flush()
}

/// Percent-decoding of a request target (`+` stays: the targets here have no spaces).
fn decode(s: &str) -> String {
    let mut parts = s.split('%');
    let mut out = parts.next().unwrap_or_default().as_bytes().to_vec();
    for part in parts {
        match part.get(..2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) => out.extend([b].iter().chain(&part.as_bytes()[2..])),
            None => out.extend(b"%".iter().chain(part.as_bytes())),
        }
    }
    String::from_utf8(out).unwrap()
}

/// A fixture of `fixtures/`: what an engine sent (`named`: with its file name).
macro_rules! fixture {
    ($name:literal) => {
        include_str!(concat!("fixtures/", $name))
    };
    (named $name:literal) => {
        ($name, fixture!($name))
    };
}

fn task_label() -> Vec<(String, String)> {
    vec![("ai.dstack.shim.task-id".to_owned(), String::new())]
}

fn strings(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| (*s).to_owned()).collect()
}

/// A `filters` query parameter of one filter.
fn one_filter(name: &str, values: &[&str]) -> HashMap<String, Vec<String>> {
    HashMap::from([(name.to_owned(), strings(values))])
}

/// Podman 4.3's events through the runtime: the engine is asked for container and image events
/// only (Docker, as well, only for the names the shim keeps: Podman's differ), and the shim
/// keeps the exits (`died` and `die`) and the removal of labelled containers.
#[tokio::test]
async fn events_are_asked_by_type_and_on_docker_by_name_and_filtered_by_the_shim() {
    let podman = VERSION_PODMAN_5_4.replace("5.4.2", "4.3.1").leak();
    let by_type = one_filter("type", &["container", "image"]);
    let mut by_name = by_type.clone();
    by_name.extend(one_filter(
        "event",
        &["die", "oom", "destroy", "untag", "delete", "prune"],
    ));
    let died = |code| EventKind::Die {
        exit_code: Some(code),
    };
    for (version, filters) in [(&*podman, by_type), (VERSION, by_name)] {
        let events = answering("GET", "/events", 200, fixture!("events-podman-4.3.jsonl"));
        let (engine, runtime) = Engine::connect(version, events).await;
        let seen: Vec<_> = runtime
            .events(&task_label(), Some(1_700_000_000_000_000_000))
            .await
            .unwrap()
            .map(|e| e.map(|e| (e.name, e.kind)).unwrap())
            .collect()
            .await;
        assert_eq!(
            seen,
            [
                ("t2-0-bbbb".to_owned(), died(3)),
                ("t3-0-cccc".to_owned(), died(1)),
                ("t2-0-bbbb".to_owned(), EventKind::Destroy),
            ]
        );
        let asked = engine.filters("/events");
        assert_eq!(asked, filters, "no label is left to the engine");
    }
}

/// Connecting asks the engine one thing, `/version` (which engine answers): no version
/// negotiation, whose second `/version` would change nothing since bollard's requests are
/// unversioned, and would delay the start-up list.
#[tokio::test]
async fn connecting_makes_one_version_request() {
    let (engine, _runtime) = Engine::connect(VERSION, |_, _| None).await;
    assert_eq!(engine.requests(), ["GET /version"]);
}

/// An unconnected runtime sends nothing until asked: a list goes out before the engine is
/// identified, `/version` is read once by `identify` (not again by a second `identify` or a
/// create that needs the engine's flavour; a GPU support question reads it again).
#[tokio::test]
async fn an_unconnected_runtime_lists_before_it_identifies_the_engine() {
    let fixture = fixture!("list-podman-4.3.json");
    let list = answering("GET", "/containers/json", 200, fixture);
    let engine = Engine::start(VERSION, list);
    let runtime = DockerRuntime::wrap(engine.client());
    assert_eq!(engine.requests(), Vec::<String>::new());
    runtime.list(&[]).await.unwrap();
    runtime.identify().await.unwrap();
    runtime.identify().await.unwrap();
    // This engine answers nothing else; what matters is that no second `/version` goes out.
    let _ = runtime
        .create(&ContainerSpec::new("t1-0-aaaa", "shim-test:1"))
        .await;
    let requests = engine.requests();
    let listed_first = requests[0].starts_with("GET /containers/json?");
    assert!(listed_first, "{requests:?}");
    let versions = requests.iter().filter(|r| *r == "GET /version").count();
    assert_eq!(versions, 1, "{requests:?}");
}

/// An engine that ORs label filters (Podman) answers containers carrying only one of two
/// labels: the runtime keeps those carrying both, and reads a `stopped` one (a state bollard
/// rejects) as a state to wait on. One label filter is sent.
#[tokio::test]
async fn a_list_keeps_only_containers_with_every_label() {
    let fixture = fixture!("list-podman-4.3.json");
    let list = answering("GET", "/containers/json", 200, fixture);
    let (engine, runtime) = Engine::connect(VERSION, list).await;
    let labels = vec![
        ("ai.dstack.shim.task-id".to_owned(), String::new()),
        ("ai.dstack.shim.owner".to_owned(), "me".to_owned()),
    ];
    let list = runtime.list(&labels).await.unwrap();
    let seen: Vec<_> = list.iter().map(|c| (c.name.as_str(), &c.state)).collect();
    let stopped = ContainerState::Other("stopped".to_owned());
    assert_eq!(seen, [("t2-0-bbbb", &stopped)]);
    let one_label = one_filter("label", &["ai.dstack.shim.owner=me"]);
    assert_eq!(engine.filters("/containers/json"), one_label);
    assert_eq!(runtime.list(&[]).await.unwrap().len(), 3);
}

/// Podman's `stopped` right after an exit: the inspect succeeds, with a state to wait on.
#[tokio::test]
async fn an_inspect_in_a_state_bollard_rejects_succeeds() {
    let fixture = fixture!("inspect-podman-4.3-stopped.json");
    let inspect = answering("GET", "/containers/t2-0-bbbb/json", 200, fixture);
    let (_engine, runtime) = Engine::connect(VERSION, inspect).await;
    let d = runtime.inspect("t2-0-bbbb").await.unwrap();
    assert_eq!(d.state, ContainerState::Other("stopped".to_owned()));
    assert!(d.state.is_running());
    assert_eq!(d.labels["ai.dstack.shim.task-id"], "t2");
    assert!(runtime.inspect("nope").await.unwrap_err().is_not_found());
}

/// An answer unreadable beyond its state is an error, which never carries the answer's text
/// (an inspect holds the container's environment).
#[tokio::test]
async fn an_unreadable_answer_is_an_error_without_its_text() {
    let broken = fixture!("inspect-podman-4.3-stopped.json")
        .replace("\"container=podman\"", "\"TOKEN=hunter2\"")
        .replace("\"RestartCount\": 0", "\"RestartCount\": \"zero\"");
    let (_engine, runtime) =
        Engine::connect(VERSION, move |_, _| Some((200, broken.clone()))).await;
    let e = runtime.inspect("t2-0-bbbb").await.unwrap_err();
    assert_matches!(e, RuntimeError::Other { .. });
    let shown = format!("{} {e:?}", shim_util::error_chain(&e));
    assert!(shown.contains("malformed answer"), "{shown}");
    assert!(!shown.contains("hunter2"), "{shown}");
}

/// A bind source missing on the host fails the create with the path, and nothing is made
/// there. Podman (which would make a directory at the path) is never asked; Docker is asked
/// and refuses, as it does, and the shim then names the missing source. A create Docker
/// refuses with every source present keeps Docker's own error. Every source present: created.
#[tokio::test]
async fn a_missing_bind_source_fails_the_create_with_its_path() {
    for version in [VERSION_PODMAN_5_4, VERSION] {
        let podman = version == VERSION_PODMAN_5_4;
        // Refuses as Docker does (moby's volume/mounts: `bind source path does not exist`)
        // while `refuse` holds.
        let refuse = Arc::new(AtomicBool::new(true));
        let refusing = refuse.clone();
        let refusal = r#"{"message":"bind source path does not exist"}"#;
        let refused = answering("POST", "/containers/create", 400, refusal);
        let created = creating();
        let (engine, runtime) = Engine::connect(version, move |method, target| {
            match refusing.load(Ordering::SeqCst) {
                true => refused(method, target),
                false => created(method, target),
            }
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-runner").join("dstack-runner");
        let mut spec = ContainerSpec::new("t5-0-eeee", "shim-test:1");
        for (source, target) in [(dir.path(), "/tmp/runner"), (&*missing, "/usr/local/bin/r")] {
            spec.mounts.push(BindMount {
                source: source.to_owned(),
                target: target.to_owned(),
                read_only: false,
            });
        }
        let e = runtime.create(&spec).await.unwrap_err();
        assert_matches!(
            e,
            RuntimeError::BindSourceMissing { path, .. } if *path == missing,
            "podman {podman}"
        );
        assert!(e.to_string().contains(&missing.display().to_string()));
        assert!(!missing.parent().unwrap().exists());
        let requests = engine.requests();
        let asked = requests.iter().filter(|r| r.contains("/create")).count();
        assert_eq!(asked, usize::from(!podman), "podman {podman}");
        spec.mounts.pop();
        if !podman {
            let e = runtime.create(&spec).await.unwrap_err();
            assert_matches!(e, RuntimeError::Daemon { status: 400, .. });
        }
        refuse.store(false, Ordering::SeqCst);
        assert_eq!(runtime.create(&spec).await.unwrap(), "c0ffee");
    }
}

/// A spec of container `name` with one device request.
fn spec_requesting(name: &str, driver: &str, ids: &[&str], capabilities: &[&str]) -> ContainerSpec {
    let mut spec = ContainerSpec::new(name, "shim-test:1");
    spec.device_requests = vec![DeviceRequest {
        driver: driver.to_owned(),
        device_ids: strings(ids),
        capabilities: strings(capabilities),
    }];
    spec
}

/// A spec asking for two NVIDIA GPUs, as the engine makes it (`spec::apply_gpu`).
fn nvidia_spec(name: &str) -> ContainerSpec {
    let gpus = ["GPU-aaaa", "GPU-bbbb"];
    spec_requesting(name, "nvidia", &gpus, &["gpu", "utility"])
}

/// Podman's Docker API ignores NVIDIA device requests: a create that has some is refused
/// before the engine is asked, naming the engine and why, so that no task runs without its
/// GPUs. Plain device mappings (AMD's `/dev/kfd`, render nodes) are created as usual.
#[tokio::test]
async fn gpu_device_requests_are_refused_on_podman() {
    let (engine, runtime) = Engine::connect(VERSION_PODMAN_5_4, creating()).await;
    let e = runtime.create(&nvidia_spec("t6-0-ffff")).await.unwrap_err();
    assert_matches!(
        e,
        RuntimeError::DeviceRequestsIgnored { engine, driver, .. }
            if engine == "Podman 5.4.2" && driver == "nvidia"
    );
    assert_eq!(
        e.to_string(),
        "create container t6-0-ffff: Podman 5.4.2 ignores \"nvidia\" device requests through \
         its Docker API: GPU tasks need a CDI spec there (Podman 5+; `nvidia-ctk cdi generate \
         --output=/var/run/cdi/nvidia.yaml`) or Docker"
    );
    engine.assert_never_asked("/containers/create");
    let mut amd = ContainerSpec::new("t7-0-aaaa", "shim-test:1");
    amd.devices = vec![
        DeviceMapping::same_path("/dev/kfd"),
        DeviceMapping::same_path("/dev/dri/renderD128"),
    ];
    assert_eq!(runtime.create(&amd).await.unwrap(), "c0ffee");
    let body = engine.body("/containers/create");
    assert_eq!(body["HostConfig"]["Devices"][0]["PathOnHost"], "/dev/kfd");
    assert!(body["HostConfig"]["DeviceRequests"].is_null(), "{body}");
}

/// The engine upgraded under a running shim (Podman 5.3 to 5.4, its service restarted): what
/// it can do with GPUs is read from the engine again (the shim's engine asks again after its
/// event stream was lost), and a CDI create that 5.3 would have ignored goes to 5.4.
#[tokio::test]
async fn gpu_support_reads_the_engine_again() {
    let podman_5_3 = VERSION_PODMAN_5_4.replace("5.4.2", "5.3.1").leak();
    let (engine, runtime) = Engine::connect(podman_5_3, creating()).await;
    let support = runtime.gpu_support().await.unwrap();
    assert_eq!(support.engine, "Podman 5.3.1");
    assert_eq!(support.cdi_spec_dirs, None);
    let cdi = spec_requesting("t6-0-ffff", "cdi", &["nvidia.com/gpu=0"], &[]);
    let e = runtime.create(&cdi).await.unwrap_err();
    assert_matches!(e, RuntimeError::DeviceRequestsIgnored { engine, .. } if engine == "Podman 5.3.1");
    engine.set_version(VERSION_PODMAN_5_4);
    let support = runtime.gpu_support().await.unwrap();
    assert_eq!(support.engine, "Podman 5.4.2");
    assert!(support.cdi_spec_dirs.is_some(), "{support:?}");
    assert_eq!(runtime.create(&cdi).await.unwrap(), "c0ffee");
    let body = engine.body("/containers/create");
    assert_eq!(body["HostConfig"]["DeviceRequests"][0]["Driver"], "cdi");
}

/// On Docker the same create goes to the engine, with its device request.
#[tokio::test]
async fn gpu_device_requests_are_sent_to_docker() {
    let (engine, runtime) = Engine::connect(VERSION, creating()).await;
    let created = runtime.create(&nvidia_spec("t6-0-ffff")).await.unwrap();
    assert_eq!(created, "c0ffee");
    let body = engine.body("/containers/create");
    assert_eq!(
        body["HostConfig"]["DeviceRequests"],
        serde_json::json!([{
            "Driver": "nvidia",
            "DeviceIDs": ["GPU-aaaa", "GPU-bbbb"],
            "Capabilities": [["gpu", "utility"]],
        }]),
        "{body}"
    );
}

/// Which device requests each engine honours: Docker all; Podman 5.4 and later only CDI ones;
/// Podman 4 and 5.0 to 5.3 none (its Docker API reads `DeviceRequests` only from 5.4:
/// "pkg/api: honor cdi devices from the hostconfig"). The engine is told by the version
/// answer's components.
#[test]
fn which_device_requests_each_engine_honours() {
    let podman = |version: &str| Flavour::Podman {
        version: version.to_owned(),
    };
    let flavour = |answer| Flavour::of(&serde_json::from_str(answer).unwrap());
    assert_eq!(flavour(VERSION), Flavour::Docker);
    assert_eq!(flavour(VERSION_PODMAN_5_4), podman("5.4.2"));
    let nvidia = nvidia_spec("t8-0-bbbb");
    let cdi = spec_requesting("t8-0-bbbb", "cdi", &["nvidia.com/gpu=0"], &[]);
    for (flavour, spec, honoured) in [
        (Flavour::Docker, &nvidia, true),
        (podman("5.4.2"), &nvidia, false),
        (podman("5.4.2"), &cdi, true),
        (podman("4.3.1"), &nvidia, false),
        (podman("4.3.1"), &cdi, false),
        (podman("4.3.1"), &ContainerSpec::new("t8", "x:1"), true),
        (podman("5.2.2"), &cdi, false),
        (podman("5.3.2"), &cdi, false),
        (podman("6.0.0"), &cdi, true),
    ] {
        let (ok, requests) = (
            flavour.check_device_requests(spec).is_ok(),
            &spec.device_requests,
        );
        assert_eq!(ok, honoured, "{flavour:?} {requests:?}");
    }
}

/// Pulls through the runtime, as the engines answer them: the seconds of Docker 28's
/// containerd store never count as bytes, and on every engine the finished pull reports
/// everything downloaded and extracted.
#[tokio::test]
async fn pull_progress_per_engine_through_the_runtime() {
    let request = PullRequest::new("127.0.0.1:5799/x:1")
        .with_timeout(Some(Duration::from_secs(30)))
        .with_stall_timeout(Some(Duration::from_secs(30)));
    for (engine_name, fixture) in [
        fixture!(named "pull-docker-20.10-classic.jsonl"),
        fixture!(named "pull-docker-28-containerd.jsonl"),
        fixture!(named "pull-docker-26-containerd.jsonl"),
        fixture!(named "pull-podman-4.3.jsonl"),
    ] {
        let pulling = answering("POST", "/images/create", 200, fixture);
        let (_engine, runtime) = Engine::connect(VERSION, pulling).await;
        let seen = Mutex::new(Vec::<PullProgress>::new());
        let record = |p: PullProgress| seen.lock().unwrap().push(p);
        let done = runtime
            .pull(&request, &record, CancellationToken::new())
            .await
            .unwrap();
        let all = PullProgress {
            downloaded_bytes: 3000,
            extracted_bytes: 3000,
            total_bytes: 3000,
            is_total_bytes_final: true,
        };
        assert_eq!(done, all, "{engine_name}");
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.last(), Some(&done), "{engine_name}");
        let extracted = [0, 400, 1000, 3000];
        let known = seen.iter().all(|p| extracted.contains(&p.extracted_bytes));
        assert!(known, "{engine_name}: {seen:?}");
    }
}

/// Issue 39 part 5: an engine that unpacks in silence after the last download (Docker 26–27
/// on the containerd store, Podman: nothing between the last `Download complete` and the
/// end) is not stalled while its data on disk moves: a pull silent for 2.5 s with a stall
/// timeout of 1 s succeeds while the disk grows, fails as stalled when it stands still, and
/// succeeds without a disk to watch (the silent phase then has
/// [`crate::EXTRACTION_STALL_TIMEOUT`]). A silence *before* the downloads end is a stall
/// whatever the disk does.
#[tokio::test]
async fn a_silent_unpack_is_judged_by_the_disk() {
    use std::sync::atomic::AtomicU64;
    let downloads = "{\"status\":\"Pulling from library/x\",\"id\":\"1\"}\n\
{\"status\":\"Downloading\",\"progressDetail\":{\"current\":500,\"total\":1000},\"id\":\"aaaaaaaaaaaa\"}\n";
    let done = "{\"status\":\"Download complete\",\"progressDetail\":{\"hidecounts\":true},\"id\":\"aaaaaaaaaaaa\"}\n";
    let end = "{\"status\":\"Digest: sha256:0123\"}\n{\"status\":\"Status: Downloaded newer image for 127.0.0.1:5799/x:1\"}\n";
    let silent_unpack = format!("{downloads}{done}#sleep 2500\n{end}");
    let silent_download = format!("{downloads}#sleep 2500\n{done}{end}");
    // A disk that grows by `growth` bytes at every reading: an unpack's megabytes, another
    // writer's kilobytes (a task's log: not the unpack's progress), or nothing.
    let growth = Arc::new(AtomicU64::new(0));
    let probe = {
        let (used, growth) = (AtomicU64::new(0), growth.clone());
        crate::DiskProbe::new(move || {
            let step = growth.load(Ordering::SeqCst);
            Some(used.fetch_add(step, Ordering::SeqCst) + step)
        })
    };
    let pull = |body: String, disk: Option<crate::DiskProbe>| async move {
        let pulling = answering("POST", "/images/create", 200, body);
        let (_engine, runtime) = Engine::connect(VERSION, pulling).await;
        let request = PullRequest::new("127.0.0.1:5799/x:1")
            .with_stall_timeout(Some(Duration::from_secs(1)))
            .with_disk_probe(disk);
        runtime
            .pull(&request, &|_| {}, CancellationToken::new())
            .await
    };
    let unpacks = crate::EXTRACTION_GROWTH_MIN;
    // (row, the pull's answer, the disk's growth per reading, whether it is watched, whether
    // the pull stalls), in this order: the disk's use adds up.
    for (row, body, step, watched, stalls) in [
        ("a_moving_disk", &silent_unpack, unpacks, true, false),
        ("a_silent_download", &silent_download, unpacks, true, true),
        ("another_writers_bytes", &silent_unpack, 4096, true, true),
        ("a_still_disk", &silent_unpack, 0, true, true),
        ("no_disk_to_watch", &silent_unpack, 0, false, false),
    ] {
        growth.store(step, Ordering::SeqCst);
        let result = pull(body.clone(), watched.then(|| probe.clone())).await;
        let stalled = matches!(result, Err(RuntimeError::PullStalled { .. }));
        let got = (result.is_ok(), stalled);
        assert_eq!(got, (!stalls, stalls), "{row}: {result:?}");
    }
}

/// A create whose name is in use is a conflict on every engine: Docker answers 409, Podman
/// 500 ("that name is already in use"), which the runtime tells by the container of that name
/// existing. Another refused create (500, no such container) stays the engine's error.
#[tokio::test]
async fn a_name_in_use_is_a_conflict_on_every_engine() {
    const PODMAN: &str = r#"{"cause":"that name is already in use","message":"container create: creating container storage: the container name \"taken\" is already in use by 3c3c. You have to remove that container to be able to reuse that name: that name is already in use","response":500}"#;
    for (engine_name, status, message) in [
        (
            "docker",
            409,
            r#"{"message":"Conflict. The container name \"/taken\" is already in use by container \"3c3c\"."}"#,
        ),
        ("podman", 500, PODMAN),
    ] {
        let (_engine, runtime) = Engine::connect(VERSION, move |method, target| {
            let create = method == "POST" && target.starts_with("/containers/create?");
            if create && target.contains("name=taken") {
                Some((status, message.to_owned()))
            } else if create && target.contains("name=free") {
                Some((500, r#"{"message":"fill out specgen: no"}"#.to_owned()))
            } else if method == "GET" && target.starts_with("/containers/taken/json") {
                let stopped = fixture!("inspect-podman-4.3-stopped.json");
                Some((200, stopped.to_owned()))
            } else {
                None
            }
        })
        .await;
        let spec = |name| ContainerSpec::new(name, "shim-test:1");
        let e = runtime.create(&spec("taken")).await.unwrap_err();
        assert_matches!(e, RuntimeError::Conflict { .. }, "{engine_name}");
        let e = runtime.create(&spec("free")).await.unwrap_err();
        assert_matches!(e, RuntimeError::Daemon { status: 500, .. }, "{engine_name}");
    }
}

/// An engine whose image `labelled:1` carries `exitCode` and `containerExitCode` labels and
/// whose `plain:1` carries another, creating every container.
fn images_and_creates() -> impl Script {
    let labelled = r#"{"Id":"sha256:1a","Config":{"Labels":{"exitCode":"0","containerExitCode":"0","x":"y"}}}"#;
    let plain = r#"{"Id":"sha256:2b","Config":{"Labels":{"x":"y"}}}"#;
    let (labelled, plain, create) = (
        answering("GET", "/images/labelled:1/json", 200, labelled),
        answering("GET", "/images/plain:1/json", 200, plain),
        creating(),
    );
    move |m: &str, t: &str| {
        labelled(m, t)
            .or_else(|| plain(m, t))
            .or_else(|| create(m, t))
    }
}

/// Docker copies a container's labels into its `die` event after the exit code (moby
/// daemon/events.go), so an image labelled `exitCode=0` would make every task of it read as
/// done: the create sets those labels empty (the event then carries no number, and the engine
/// inspects the container), and leaves the image's other labels and every other image's
/// alone. What the pull step's inspect learnt costs the create no request; an image it never
/// saw is inspected once.
#[tokio::test]
async fn an_images_exit_code_labels_are_set_empty_in_the_create() {
    let (engine, runtime) = Engine::connect(VERSION, images_and_creates()).await;
    assert!(runtime.image_present("labelled:1").await.unwrap());
    runtime
        .create(&ContainerSpec::new("t-0-aaaa", "labelled:1"))
        .await
        .unwrap();
    let body = engine.body("/containers/create");
    assert_eq!(body["Labels"]["exitCode"], "", "{body}");
    assert_eq!(body["Labels"]["containerExitCode"], "", "{body}");
    assert!(body["Labels"].get("x").is_none(), "{body}");
    let inspects = |engine: &Engine| {
        let requests = engine.requests();
        requests
            .iter()
            .filter(|r| r.starts_with("GET /images/"))
            .count()
    };
    assert_eq!(inspects(&engine), 1);

    let (engine, runtime) = Engine::connect(VERSION, images_and_creates()).await;
    let plain = |name| ContainerSpec::new(name, "plain:1");
    runtime.create(&plain("t-0-bbbb")).await.unwrap();
    runtime.create(&plain("t-1-bbbb")).await.unwrap();
    assert_eq!(inspects(&engine), 1, "one inspect for two creates");
    let requests = engine.requests.lock().unwrap();
    let creates: Vec<_> = requests
        .iter()
        .filter(|(line, _)| line.contains("/create"))
        .collect();
    assert_eq!(creates.len(), 2, "{requests:?}");
    let unlabelled = creates.iter().all(|(_, body)| !body.contains("exitCode"));
    assert!(unlabelled, "{creates:?}");
}

/// The pull log keeps what the engine said once: Docker 28's containerd store repeats each
/// layer's last line every 100 ms while nothing arrives, and a pull that trickles for hours
/// would otherwise write them all into the home. Past `PULL_LOG_MAX_BYTES` a pull's messages
/// are no longer written.
#[tokio::test]
async fn the_pull_log_keeps_no_repeats_and_is_bounded() {
    let downloading = "{\"status\":\"Downloading\",\"progressDetail\":{\"current\":500,\"total\":1000},\"id\":\"aaaaaaaaaaaa\"}\n";
    let done = "{\"status\":\"Download complete\",\"id\":\"aaaaaaaaaaaa\"}\n{\"status\":\"Digest: sha256:0123\"}\n";
    let body = format!("{}{done}", downloading.repeat(1000));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("pull.log");
    let pulling = answering("POST", "/images/create", 200, body);
    let (_engine, runtime) = Engine::connect(VERSION, pulling).await;
    let request = PullRequest::new("127.0.0.1:5799/x:1").with_log_path(Some(log.clone()));
    let cancel = CancellationToken::new();
    runtime.pull(&request, &|_| {}, cancel).await.unwrap();
    let text = fs_err::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[0].contains("Downloading"), "{lines:?}");

    // A pull that says something new in every message, past the bound.
    let many = (0..200_000)
        .map(|i| format!("{{\"status\":\"Downloading\",\"progressDetail\":{{\"current\":{i},\"total\":1000000}},\"id\":\"aaaaaaaaaaaa\"}}\n"))
        .collect::<String>();
    let pulling = answering("POST", "/images/create", 200, many);
    let (_engine, runtime) = Engine::connect(VERSION, pulling).await;
    let cancel = CancellationToken::new();
    runtime.pull(&request, &|_| {}, cancel).await.unwrap();
    let size = fs_err::metadata(&log).unwrap().len();
    assert!(size <= (16 << 20) + 200, "{size}");
    let text = fs_err::read_to_string(&log).unwrap();
    let end = &text[text.len() - 200..];
    assert!(end.ends_with("the log is full)\"}\n"), "{end}");
}

/// A logs answer whose body stalls after its head (Docker 26+ sends the head before it reads
/// the log; a hung data root then stalls the read) ends within the request timeout, as an
/// error: it used to hold its caller (an exit's settlement, the reconciler's cycle, the first
/// cycle before the API serves) for good, bollard's own bound ending at the head.
#[tokio::test]
async fn a_logs_answer_that_stalls_after_its_head_times_out() {
    let stalled = "\n#sleep 60000\n";
    let (_engine, runtime) = Engine::connect(
        VERSION,
        answering("GET", "/containers/x/logs", 200, stalled),
    )
    .await;
    let runtime = runtime.with_request_timeout(Duration::from_secs(1));
    let started = std::time::Instant::now();
    let tail = tokio::time::timeout(Duration::from_secs(20), runtime.logs_tail("x", 5)).await;
    let took = started.elapsed();
    let tail = tail.expect("the read stalled on");
    assert!(tail.is_err(), "{tail:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}
