//! The `dstack-shim` binary: flags, logging, signals, the component installer and the HTTP
//! API, wired to the task engine.
//!
//! Start-up order matters: the engine restores tasks from their containers and state files
//! and completes one reconcile cycle *before* the API listens, so the first answer about any
//! task already reflects containers that ended while the shim was down. Shutdown (SIGTERM,
//! SIGINT, `POST /api/shutdown`) never stops containers.

mod adapter;
mod argv;
mod components;
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
use shim_components::{ComponentName, Components, ComponentsConfig};
use shim_http::{Listeners, ServerConfig, ShimApi, serve};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, VERSION};

/// The most async worker threads (one per core up to this).
const MAX_WORKER_THREADS: usize = 4;
/// The most threads for blocking work (durable writes, key files, mounts) at once.
const MAX_BLOCKING_THREADS: usize = 32;

fn main() -> ExitCode {
    let config = match Config::from_process() {
        Ok(c) => c,
        Err(e) => {
            #[allow(clippy::print_stderr)] // no logger yet
            {
                eprintln!("dstack-shim: {e:#}");
            }
            return ExitCode::FAILURE;
        }
    };
    if config.help {
        use clap::CommandFactory as _;
        #[allow(clippy::print_stdout)] // the one thing help does
        {
            println!("{}", config::Args::command().render_help());
        }
        return ExitCode::SUCCESS;
    }
    if config.version {
        // Exactly three words: the server's component check (and upstream's own start-up
        // check) splits this output (upstream `runner/internal/shim/components/utils.go`).
        #[allow(clippy::print_stdout)] // the one thing --version does
        {
            println!("dstack-shim version {VERSION}");
        }
        return ExitCode::SUCCESS;
    }
    // The shim waits on Docker, the disk and its clients; it computes little. A few workers
    // and a bounded blocking pool (state writes, authorized_keys, mounts) keep its threads,
    // and with them glibc's per-thread malloc arenas, few on hosts with many cores.
    let workers = std::thread::available_parallelism()
        .map_or(2, std::num::NonZeroUsize::get)
        .clamp(2, MAX_WORKER_THREADS);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .max_blocking_threads(MAX_BLOCKING_THREADS)
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
    // One shim per home: a second one would restore, sweep and move aside what the first
    // one is using. Held until the process exits.
    let _home_lock = lock_home(&home)?;
    logging::init(config.shim_log_level, config.log_format, &home)?;
    tracing::info!(version = VERSION, dstack_api = config::DSTACK_VERSION, home = %home.display(), "starting dstack-shim");
    rlimit::raise_open_files_limit();
    // A download URL may carry credentials in its query (presigned URLs).
    let shown = Config {
        runner_download_url: shim_components::redact_url(&config.runner_download_url),
        ..config.clone()
    };
    tracing::debug!(config = ?shown, "configuration");

    let shutdown = CancellationToken::new();
    let force = CancellationToken::new();
    signals::spawn(shutdown.clone(), force.clone()).context("cannot listen for signals")?;

    let components = Components::new(ComponentsConfig::new(
        &config.runner_binary_path,
        config.shim_binary()?,
    ));
    if !config.runner_download_url.is_empty() {
        let url = config.runner_download_url.as_str();
        if !config.runner_binary_path.exists() {
            components
                .install(ComponentName::Runner, url)
                .await
                .context("cannot install the runner")?;
        }
    }

    // The port is bound first, so a taken port fails before anything is restored. The engine
    // restores every task and completes its first reconcile cycle before the API answers:
    // the first answer about any task already reflects what happened while the shim was down
    // (connections wait in the backlog meanwhile).
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, config.shim_http_port));
    let listeners = Listeners::bind(addr, config.unix_socket.as_deref()).await?;
    let (engine, dcgm) = engine::open(&config, &home).await?;
    let api: Arc<dyn ShimApi> = Arc::new(adapter::EngineApi::new(engine.clone(), dcgm.clone()));

    let drain = {
        let components = components.clone();
        let engine = engine.clone();
        async move {
            // Downloads are cancelled on every shutdown, graceful or not (upstream:
            // runner/internal/shim/api/server.go, Shutdown: bgJobsCancel).
            components.cancel();
            components.wait_idle().await;
            // Start jobs in flight finish (bounded) so no task is left half-started.
            engine
                .shutdown(shim_engine::Shutdown::Graceful(engine::SHUTDOWN_GRACE))
                .await;
        }
    };
    let server_config = ServerConfig::new(VERSION)
        .with_force_shutdown(force.clone())
        .with_drain(drain);
    serve(
        listeners,
        api,
        Arc::new(components::ComponentsHttp(components.clone())),
        server_config,
        shutdown,
    )
    .await?;
    if force.is_cancelled() {
        components.cancel();
    }
    engine.shutdown(shim_engine::Shutdown::Now).await;
    dcgm.shutdown().await;
    tracing::info!("dstack-shim stopped; containers keep running");
    Ok(())
}

/// Takes an exclusive lock on `<home>/dstack-shim.lock`, or fails at once if another shim
/// holds it.
fn lock_home(home: &std::path::Path) -> anyhow::Result<shim_fs::FileLock> {
    let path = home.join("dstack-shim.lock");
    shim_fs::FileLock::try_exclusive(&path)?.ok_or_else(|| {
        anyhow::anyhow!(
            "another dstack-shim uses the home {} (it holds {})",
            home.display(),
            path.display()
        )
    })
}
