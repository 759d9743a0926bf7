//! An example host agent built on `shim-engine`, as an outside project embeds it: it opens an
//! engine on a temporary home, subscribes to task changes, runs one task until it runs,
//! terminates and removes it, and shows the engine's readiness and metrics in its own
//! Prometheus registry.
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

use shim_engine::prometheus_client::registry::Registry;
use shim_engine::{ChangeKind, Deps, Engine, EngineConfig, Shutdown, SubscriptionError};
use shim_resources::fake::{FakeAuthorizedKeys, FakeVolumes};
use shim_resources::{AuthorizedKeysManager, BlockVolumes, SystemCommandRunner, VolumeConfig};
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
        let commands = Arc::new(SystemCommandRunner::default());
        let deps = Deps::new(
            Arc::new(DockerRuntime::connect().await?),
            Arc::new(AuthorizedKeysManager::system()),
            Arc::new(BlockVolumes::new(VolumeConfig::default(), commands)),
        );
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
    let mut registry = Registry::default();
    engine.register_metrics(&mut registry);

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

    let mut text = String::new();
    shim_engine::prometheus_client::encoding::text::encode(&mut text, &registry)?;
    let submitted = text
        .lines()
        .find(|l| l.starts_with("dstack_shim_tasks_submitted"))
        .ok_or("no dstack_shim_tasks_submitted in the registry")?;
    println!("metrics: {submitted}");

    engine
        .shutdown(Shutdown::Graceful(Duration::from_secs(5)))
        .await;
    Ok(())
}
