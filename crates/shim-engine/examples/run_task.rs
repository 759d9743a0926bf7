//! Runs one task on the local Docker daemon with the engine, as an embedding agent would, and
//! prints its lifecycle.
//!
//! ```sh
//! cargo run -p shim-engine --example run_task -- [IMAGE] [RUNNER]
//! # e.g., after `cargo xtask dev-env`:
//! cargo run -p shim-engine --example run_task -- shim-test:1 testdata/runner/dstack-runner
//! ```
//!
//! The runner is any executable: the engine bind-mounts it into the container and starts it
//! with the runner's command line. The task is terminated after a few seconds of running and
//! then removed; the shim home is a temporary directory.
#![allow(clippy::print_stdout, clippy::print_stderr)] // an example's output is the point

use std::sync::Arc;
use std::time::Duration;

use shim_engine::{ChangeKind, Deps, Engine, EngineConfig, SubscriptionError};
use shim_resources::{AuthorizedKeysManager, BlockVolumes, VolumeConfig};
use shim_runtime::DockerRuntime;
use shim_task::{NetworkMode, TaskConfig, TaskId, TaskName, TaskStatus, TerminationReason};
use shim_util::SystemCommandRunner;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let image = args.next().unwrap_or_else(|| "shim-test:1".to_owned());
    let runner = args
        .next()
        .unwrap_or_else(|| "testdata/runner/dstack-runner".to_owned());
    let home = tempfile::tempdir()?;

    let commands = Arc::new(SystemCommandRunner::default());
    // A host without GPUs (`deps.host_gpus` takes what `GpuDetector` finds).
    let deps = Deps::new(
        Arc::new(DockerRuntime::connect().await?),
        Arc::new(AuthorizedKeysManager::system()),
        Arc::new(BlockVolumes::new(VolumeConfig::default(), commands)),
    );
    let mut cfg = EngineConfig::new(home.path());
    cfg.runner_binary_path = std::path::absolute(&runner)?;
    let engine = Engine::open(cfg, deps).await?;
    println!("engine ready; owner identity {}", engine.owner());

    // Subscribe before submitting: every change of the task arrives, in order.
    let mut changes = engine.subscribe();
    let id = TaskId::new(format!("example-{}", std::process::id()))?;
    let mut config = TaskConfig::new(id.clone(), TaskName::new("example")?, image);
    config.network_mode = NetworkMode::Bridge;
    let info = engine.submit(config).await?;
    println!("submitted: {} {}", info.id, info.status);

    let mut terminated = false;
    while !terminated {
        let change = match changes.recv().await {
            Ok(change) if change.task == id => change,
            Ok(_) => continue,
            Err(SubscriptionError::Lagged { .. }) => {
                // Fell behind: the task's state now is the resync.
                println!("resync: {:?}", engine.task_info(&id)?.status);
                continue;
            }
            // Closed (or what a later version adds): the engine is gone.
            Err(_) => break,
        };
        println!("#{} {:?}", change.seq, change.kind);
        match change.kind {
            ChangeKind::Status {
                status: TaskStatus::Running,
            } => {
                let info = engine.task_info(&id)?;
                println!(
                    "running: container={} ports={:?}",
                    info.container_name, info.ports
                );
                tokio::time::sleep(Duration::from_secs(2)).await;
                engine
                    .terminate(
                        &id,
                        TerminationReason::TerminatedByUser,
                        "example done".to_owned(),
                        Duration::from_secs(5),
                    )
                    .await?;
            }
            ChangeKind::Terminated { .. } => terminated = true,
            _ => {}
        }
    }
    engine.remove(&id).await?;
    println!("removed");
    engine
        .shutdown(shim_engine::Shutdown::Graceful(Duration::from_secs(5)))
        .await;
    Ok(())
}
