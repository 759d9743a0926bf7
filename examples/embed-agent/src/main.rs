//! An example host agent built on `shim-engine`, as an outside project embeds it: it opens an
//! engine on a temporary home, serves dstack's HTTP API over it on a loopback port
//! (`shim-http`'s `EngineApi`), subscribes to task changes, runs one task until it runs, reads
//! it back through the API, terminates and removes it, and reads the metrics through the API.
//!
//! - With `SHIM_TEST_DOCKER=1`: on the local Docker daemon, the image `SHIM_TEST_IMAGE`
//!   (default `shim-test:1`, made by the shim's `cargo xtask dev-env`) and the runner
//!   `SHIM_TEST_RUNNER` (default: the shim repository's stub runner).
//! - Otherwise: on the in-memory fake runtime (`shim-runtime`'s `test-support` feature), with
//!   fake host resources; no Docker, no root.
//!
//! It exits non-zero when the task does not go `pending → … → running → terminated` with the
//! reason it was given, or the engine is not ready.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use shim_engine::{ChangeKind, Deps, Engine, EngineConfig, HostOptions, SubscriptionError};
use shim_http::{EngineApi, EngineShutdown, Listeners, NoComponents, ServerConfig, serve};
use shim_resources::fake::{FakeAuthorizedKeys, FakeVolumes};
use shim_runtime::DockerRuntime;
use shim_runtime::fake::FakeRuntime;
use shim_task::{TaskConfig, TaskId, TaskName, TaskStatus, TerminationReason};

type AnyError = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("embed-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), AnyError> {
    let docker = std::env::var("SHIM_TEST_DOCKER").is_ok_and(|v| v == "1");
    let home = tempfile::tempdir()?;
    let image = std::env::var("SHIM_TEST_IMAGE").unwrap_or_else(|_| "shim-test:1".to_owned());

    let (deps, runner) = if docker {
        // The host as `dstack-shim` probes it: its GPUs, users' keys, block volumes, devices.
        let options = HostOptions::new(home.path().join("volumes"));
        let deps = Deps::for_host(Arc::new(DockerRuntime::connect().await?), &options).await;
        let runner = std::env::var_os("SHIM_TEST_RUNNER").map_or_else(
            || {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../testdata/runner/dstack-runner")
            },
            PathBuf::from,
        );
        (deps, std::path::absolute(runner)?)
    } else {
        let runtime = FakeRuntime::new();
        runtime.add_image(&image);
        let deps = Deps::new(
            Arc::new(runtime),
            Arc::new(FakeAuthorizedKeys::new()),
            Arc::new(FakeVolumes::new(home.path().join("volumes"))),
        );
        (deps, PathBuf::from("/usr/local/bin/dstack-runner"))
    };
    println!(
        "embed-agent: {} runtime",
        if docker { "Docker" } else { "fake" }
    );

    // SPEC's defaults but for the home and the runner binary.
    let mut cfg = EngineConfig::new(home.path().join("home"));
    cfg.runner_binary_path = runner;
    let engine = Engine::open(cfg, deps).await?;
    let health = engine.health();
    if !health.is_ready() {
        return Err(format!("engine not ready: {:?}", health.reasons()).into());
    }
    // dstack's API over the engine, on a free port of loopback.
    let listeners = Listeners::bind("127.0.0.1:0".parse()?, None).await?;
    let addr = listeners.tcp_addr();
    let stop = tokio_util::sync::CancellationToken::new();
    let version = "0.22.5+embed-agent.0.1.0";
    let api = Arc::new(EngineApi::new(engine.clone(), version));
    // The engine's part of the shutdown, as the binary's: a graceful stop in the drain, at
    // once after the server if a forced stop cut the drain short.
    let down = EngineShutdown::new(engine.clone(), Duration::from_secs(5));
    let server = tokio::spawn(serve(
        listeners,
        api,
        Arc::new(NoComponents),
        ServerConfig::new(version).with_drain(down.drain(async {})),
        stop.clone(),
    ));

    // Subscribe before submitting: every change of the task arrives, in order.
    let mut changes = engine.subscribe();
    let id = TaskId::new(format!("embed-{}", std::process::id()))?;
    let config = TaskConfig::new(id.clone(), TaskName::new("embed-agent")?, image);
    let info = engine.submit(config).await?;
    println!("submitted {} ({})", info.id, info.status);

    let mut seen = Vec::new();
    let reason = loop {
        let change = match tokio::time::timeout(Duration::from_secs(60), changes.recv()).await {
            Err(_) => return Err(format!("no change within 60 s; seen {seen:?}").into()),
            Ok(Ok(change)) if change.task == id => change,
            Ok(Ok(_)) => continue,
            Ok(Err(SubscriptionError::Lagged { .. })) => continue,
            // Closed, or what a later version adds (the type is non-exhaustive).
            Ok(Err(e)) => return Err(format!("the subscription ended: {e}").into()),
        };
        println!("change #{}: {:?}", change.seq, change.kind);
        match change.kind {
            ChangeKind::Status { status } => {
                seen.push(status);
                if status == TaskStatus::Running {
                    let answer = get(addr, &format!("/api/tasks/{id}")).await?;
                    if !answer.contains("\"status\":\"running\"") {
                        return Err(format!("the API does not show it running: {answer}").into());
                    }
                    println!("GET /api/tasks/{id}: running");
                    engine
                        .terminate(
                            &id,
                            TerminationReason::TerminatedByUser,
                            "embed-agent is done with it".to_owned(),
                            Duration::ZERO,
                        )
                        .await?;
                }
            }
            ChangeKind::Terminated {
                termination_reason, ..
            } => break termination_reason,
            _ => {}
        }
    };
    if !seen.contains(&TaskStatus::Running)
        || reason != TerminationReason::TerminatedByUser.as_str()
    {
        return Err(format!("unexpected lifecycle: statuses {seen:?}, reason {reason}").into());
    }
    engine.remove(&id).await?;
    println!("removed {id}");

    let metrics = get(addr, "/metrics").await?;
    let submitted = metrics
        .lines()
        .find(|l| l.starts_with("dstack_shim_tasks_submitted"))
        .ok_or("no dstack_shim_tasks_submitted in GET /metrics")?;
    println!("GET /metrics: {submitted}");

    stop.cancel();
    server.await??;
    down.finish().await;
    Ok(())
}

/// One `GET` of the API (HTTP/1.1, the connection closed after it): the whole answer.
async fn get(addr: std::net::SocketAddr, path: &str) -> Result<String, AnyError> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    Ok(answer)
}
