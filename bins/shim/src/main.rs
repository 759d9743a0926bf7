//! The `dstack-shim` binary: flags, logging, signals, the component installer and the HTTP
//! API, wired to the task engine.
//!
//! Start-up order matters: the engine restores tasks from their containers and state files
//! and completes one reconcile cycle *before* the API listens, so the first answer about any
//! task already reflects containers that ended while the shim was down. Shutdown (SIGTERM,
//! SIGINT, `POST /api/shutdown`) never stops containers. A `POST /api/shutdown` after a new
//! binary was installed is an upgrade in place (`upgrade`): the process `exec`s the new
//! binary, which takes over the listening socket (`listen_fds`).

mod argv;
mod config;
mod engine;
mod listen_fds;
mod logging;
mod rlimit;
mod signals;
mod upgrade;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use shim_components::{ComponentName, Components, ComponentsConfig};
use shim_http::{
    ComponentsHttp, EngineApi, EngineShutdown, Listeners, ServerConfig, ShimApi, serve,
};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, VERSION};

/// The most threads for blocking work (durable writes, key files, mounts) at once.
const MAX_BLOCKING_THREADS: usize = 32;

/// How the server's run ended.
enum Exit {
    /// Stopped: exit.
    Stopped,
    /// Replace this process with the new binary, unless the flag says a stop signal came
    /// ([`signals::stop_flag`]).
    Upgrade(upgrade::Handover, Arc<AtomicBool>),
}

/// How long the exit waits for the async runtime's last tasks and blocking threads.
const RUNTIME_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(2);

fn main() -> ExitCode {
    let code = shim_main();
    // The lines logged so far written (their writers are threads that die with the process).
    logging::flush();
    code
}

fn shim_main() -> ExitCode {
    // First, before anything opens a file: a socket passed by systemd or by the image this
    // process replaced claims fd 3.
    let inherited = match listen_fds::take() {
        Ok(socket) => socket,
        Err(e) => {
            #[allow(clippy::print_stderr)] // no logger yet
            {
                eprintln!("dstack-shim: {e:#}");
            }
            return ExitCode::FAILURE;
        }
    };
    let watchdog = std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == upgrade::WATCH_COMMAND);
    if watchdog {
        upgrade::block_stop_signals();
    }
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
        #[allow(clippy::print_stdout)] // the one thing help does
        {
            println!("{}", config::command().render_help());
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
    if watchdog {
        return upgrade::watch_main(&config);
    }
    // The shim waits on Docker, the disk and its clients; it computes little: its async work
    // runs on this one thread (no wake-ups between workers: 8 % less CPU a task than two
    // workers, docs/BENCHMARKS.md), and a bounded blocking pool (state writes,
    // authorized_keys, mounts, file lookups) takes whatever blocks, so the threads, and with
    // them glibc's per-thread malloc arenas, stay few on hosts with many cores.
    let runtime = match tokio::runtime::Builder::new_current_thread()
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
    let result = runtime.block_on(run(config, inherited));
    // What still runs on the blocking pool (a component download that stalls, which the
    // shutdown cancelled) does not hold the exit: a drop of the runtime would wait for it.
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    match result {
        Ok(Exit::Stopped) => ExitCode::SUCCESS,
        Ok(Exit::Upgrade(handover, stopped)) => {
            // No thread but this one from here on (the runtime is shut down above): the
            // exec moves the socket to fd 3.
            let e = upgrade::exec(handover, &stopped);
            if e.is::<upgrade::StoppedDuringHandoff>() {
                tracing::info!("{e}; containers keep running");
                return ExitCode::SUCCESS;
            }
            tracing::error!("{e:#}");
            #[allow(clippy::print_stderr)] // fd 3 (perhaps the log file) may be the socket now
            {
                eprintln!("dstack-shim: {e:#}");
            }
            ExitCode::FAILURE
        }
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

async fn run(config: Config, inherited: Option<std::net::TcpListener>) -> anyhow::Result<Exit> {
    let home = config.home()?;
    // The directories made for the home, innermost first.
    let made: Vec<PathBuf> = home
        .ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && std::fs::symlink_metadata(p).is_err())
        .map(Path::to_owned)
        .collect();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&home)
        .with_context(|| format!("cannot create the home directory {}", home.display()))?;
    // Their entries made durable: a submit acknowledged into a home made just now survives a
    // power cut (the store fsyncs only the home and what is under it).
    let unsynced: Vec<String> = (made.iter())
        .filter_map(|dir| dir.parent())
        .filter_map(|parent| shim_fs::Dir::open(parent).and_then(|d| d.sync()).err())
        .map(|e| e.to_string())
        .collect();
    // One shim per home: a second one would restore, sweep and move aside what the first
    // one is using. Held until the process exits.
    let _home_lock = lock_home(&home)?;
    logging::init(config.shim_log_level, config.log_format, &home)?;
    for error in unsynced {
        tracing::warn!(home = %home.display(), %error, "cannot make the new home directory durable");
    }
    tracing::info!(version = VERSION, dstack_api = config::DSTACK_VERSION, home = %home.display(), "starting dstack-shim");
    rlimit::raise_open_files_limit();
    let watchdog = upgrade::reap_watchdog();
    // A download URL may carry credentials in its query (presigned URLs).
    let shown = Config {
        runner_download_url: shim_components::redact_url(&config.runner_download_url),
        ..config.clone()
    };
    tracing::debug!(config = ?shown, "configuration");

    let shutdown = CancellationToken::new();
    let force = CancellationToken::new();
    // A signal shuts down and rules out an upgrade in place (systemd stops the unit).
    let signalled = CancellationToken::new();
    signals::spawn(signalled.clone(), force.clone()).context("cannot listen for signals")?;
    let stopped = signals::stop_flag().context("cannot listen for signals")?;
    // A stop asked of this image before the upgrade that started it was confirmed is no
    // failed start: the watchdog, which would roll the binary back, is dismissed.
    tokio::spawn({
        let signalled = signalled.clone();
        async move {
            signalled.cancelled().await;
            watchdog.dismiss();
        }
    });

    let shim_binary = config.shim_binary()?;
    let mut components_config =
        ComponentsConfig::new(&config.engine.runner_binary_path, &shim_binary);
    // A shim binary an upgrade rolled back within the hour is not installed again.
    components_config.rollback_home = Some(home.clone());
    let components = Components::new(components_config);
    {
        let components = components.clone();
        tokio::task::spawn_blocking(move || components.remove_interrupted_downloads()).await?;
    }
    // Again later, for what was too young now (a kill mid-download, then systemd's restart).
    tokio::spawn({
        let (components, shutdown) = (components.clone(), shutdown.clone());
        async move { components.sweep_interrupted_downloads(shutdown).await }
    });
    let upgrader = upgrade::Upgrader::new(shim_binary, home.clone(), components.clone());
    upgrader.load_record().await;
    if !config.runner_download_url.is_empty() {
        let url = config.runner_download_url.as_str();
        if !config.engine.runner_binary_path.exists() {
            // A signal stops the shim during the install too (the download is cancelled; one
            // that stalls is left to the runtime's bounded shutdown).
            tokio::select! {
                installed = components.install(ComponentName::Runner, url) => {
                    installed.context("cannot install the runner")?;
                }
                () = signalled.cancelled() => {
                    components.cancel();
                    tracing::info!("dstack-shim stopped by a signal while installing the runner");
                    return Ok(Exit::Stopped);
                }
            }
        }
    }

    // The port is bound first, so a taken port fails before anything is restored. The engine
    // restores every task and completes its first reconcile cycle before the API answers:
    // the first answer about any task already reflects what happened while the shim was down
    // (connections wait in the backlog meanwhile).
    let listeners = match inherited {
        Some(socket) => {
            let listeners = Listeners::from_tcp(socket, config.unix_socket.as_deref())?;
            let addr = listeners.tcp_addr();
            if addr.port() != config.shim_http_port {
                tracing::warn!(%addr, configured = config.shim_http_port,
                    "the socket passed by the parent is not on the configured port; serving it");
            }
            tracing::info!(%addr, "serving the listening socket passed by the parent (an upgrade in place or systemd socket activation)");
            listeners
        }
        None => {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, config.shim_http_port));
            Listeners::bind(addr, config.unix_socket.as_deref()).await?
        }
    };
    // A duplicate of the listening socket, kept while an upgrade in place may come: it hands
    // the socket to the new binary, and connections wait in its backlog meanwhile.
    let handoff = upgrade::Handoff::new(
        listeners
            .tcp_fd()
            .try_clone_to_owned()
            .context("cannot duplicate the listening socket")?,
        listeners.tcp_addr(),
    );
    {
        let (handoff, shutdown, signalled) = (handoff.clone(), shutdown.clone(), signalled.clone());
        tokio::spawn(async move {
            signalled.cancelled().await;
            handoff.no_upgrade();
            shutdown.cancel();
        });
    }
    let (engine, dcgm) = match engine::open(&config, &home, &signalled).await {
        Err(e) if e.is::<engine::StoppedWaiting>() => {
            tracing::info!("{e}");
            return Ok(Exit::Stopped);
        }
        opened => opened?,
    };
    let api: Arc<dyn ShimApi> =
        Arc::new(EngineApi::new(engine.clone(), VERSION).with_dcgm(dcgm.clone()));

    let engine_down = EngineShutdown::new(engine.clone(), engine::SHUTDOWN_GRACE);
    let drain = engine_down.drain({
        let components = components.clone();
        async move {
            // Downloads are cancelled on every shutdown, graceful or not (upstream:
            // runner/internal/shim/api/server.go, Shutdown: bgJobsCancel).
            components.cancel();
            components.wait_idle().await;
        }
    });
    let server_config = ServerConfig::new(VERSION)
        .with_force_shutdown(force.clone())
        .with_drain(drain)
        .with_shutdown_hook(upgrade::shutdown_hook(
            upgrader,
            handoff.clone(),
            shutdown.clone(),
            force.clone(),
        ));
    serve(
        listeners,
        api,
        Arc::new(ComponentsHttp(components.clone())),
        server_config,
        shutdown,
    )
    .await?;
    let mut handover = handoff.take();
    if let Some(handover) = &mut handover {
        handover.start_watchdog();
    }
    if force.is_cancelled() {
        components.cancel();
    }
    // Once: by the drain, or here when a forced shutdown cut the drain short.
    engine_down.finish().await;
    dcgm.shutdown().await;
    match handover {
        None => {
            tracing::info!("dstack-shim stopped; containers keep running");
            Ok(Exit::Stopped)
        }
        // A stop (systemd's, a reboot's) came during the hand-off: it is honoured, and the
        // new binary runs at the next start.
        Some(handover) if signalled.is_cancelled() => {
            handover.abandon();
            tracing::info!(
                "dstack-shim stopped by a signal during an upgrade in place; the new binary runs at the next start; containers keep running"
            );
            Ok(Exit::Stopped)
        }
        Some(handover) => Ok(Exit::Upgrade(handover, stopped)),
    }
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
