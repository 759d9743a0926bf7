//! The `dstack-shim` binary: flags, logging, signals, the component installer and the HTTP
//! API, wired to the task engine.
//!
//! Start-up order matters: the engine restores tasks from their containers and state files
//! and completes one reconcile cycle *before* the API listens, so the first answer about any
//! task already reflects containers that ended while the shim was down. Shutdown (SIGTERM,
//! SIGINT, `POST /api/shutdown`) never stops containers.

mod adapter;
mod config;
mod engine;
mod logging;
mod rlimit;
mod signals;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::DirBuilderExt;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use shim_components::{Components, ComponentsConfig};
use shim_http::{ComponentName, Listeners, ServerConfig, ShimApi, serve};
use tokio_util::sync::CancellationToken;

use crate::config::{API_VERSION, Config, VERSION};

fn main() -> ExitCode {
    let config = Config::parse();
    if config.version {
        #[allow(clippy::print_stdout)] // the one thing --version does
        {
            println!("dstack-shim version {VERSION}");
        }
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            #[allow(clippy::print_stderr)] // no logger yet
            {
                eprintln!("dstack-shim: cannot start the async runtime: {e}");
            }
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            #[allow(clippy::print_stderr)] // the logger may not be installed yet
            if !tracing::dispatcher::has_been_set() {
                eprintln!("dstack-shim: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let home = config.home()?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&home)
        .with_context(|| format!("cannot create the home directory {}", home.display()))?;
    logging::init(config.log_level()?, &home)?;
    tracing::info!(version = VERSION, api_version = API_VERSION, home = %home.display(),
        "starting dstack-shim");
    rlimit::raise_open_files_limit();
    tracing::debug!(?config, pass_env = ?config.pass_env_names(), "configuration");

    let shutdown = CancellationToken::new();
    let force = CancellationToken::new();
    signals::spawn(shutdown.clone(), force.clone()).context("cannot listen for signals")?;

    let components = Components::new(ComponentsConfig::new(
        &config.runner_binary_path,
        config.shim_binary()?,
    ));
    if let Some(url) = config
        .runner_download_url
        .as_deref()
        .filter(|u| !u.is_empty())
    {
        if !config.runner_binary_path.exists() {
            components
                .install(ComponentName::Runner, url)
                .await
                .context("cannot install the runner")?;
        }
    }

    // The engine restores every task and completes its first reconcile cycle before the API
    // listens: the first answer about any task already reflects what happened while the shim
    // was down.
    let engine = engine::open(&config, &home).await?;
    let api: Arc<dyn ShimApi> = Arc::new(adapter::EngineApi::new(engine.clone()));

    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, config.shim_http_port));
    let listeners = Listeners::bind(addr, config.unix_socket.as_deref()).await?;
    let drain = {
        let components = components.clone();
        let engine = engine.clone();
        async move {
            components.wait_idle().await;
            // Start jobs in flight finish (bounded) so no task is left half-started.
            engine.shutdown(true, engine::SHUTDOWN_GRACE).await;
        }
    };
    let server_config = ServerConfig::new(API_VERSION)
        .with_force_shutdown(force.clone())
        .with_drain(drain);
    serve(
        listeners,
        api,
        Arc::new(components.clone()),
        server_config,
        shutdown,
    )
    .await?;
    if force.is_cancelled() {
        components.cancel();
    }
    engine.shutdown(false, std::time::Duration::ZERO).await;
    tracing::info!("dstack-shim stopped; containers keep running");
    Ok(())
}
