//! Logs go to stderr and are appended to `<home>/shim.log`.

use std::io::IsTerminal as _;
use std::path::Path;
use std::sync::Mutex;

use anyhow::Context;
use fs_err::os::unix::fs::OpenOptionsExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// The log file's name in the home.
pub const LOG_FILE: &str = "shim.log";

/// Installs the global subscriber: `level` (or `RUST_LOG` when set) to stderr and to
/// `<home>/shim.log` (append, created 0600), as text lines or, with [`LogFormat::Json`], one
/// JSON object per line whose fields (task ids, errors, …) are keys of their own.
pub fn init(level: LevelFilter, format: LogFormat, home: &Path) -> anyhow::Result<()> {
    let path = home.join(LOG_FILE);
    let file = fs_err::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .context("cannot open the log file")?;
    let filter = if std::env::var_os(EnvFilter::DEFAULT_ENV).is_some() {
        EnvFilter::builder()
            .with_default_directive(level.into())
            .from_env()
            .context("invalid RUST_LOG")?
    } else {
        own_crates_at(level)?
    };
    let registry = tracing_subscriber::registry().with(filter);
    let installed = match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(Mutex::new(file)),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(std::io::stderr),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(Mutex::new(file)),
            )
            .try_init(),
    };
    installed.context("cannot install the logger")?;
    Ok(())
}

/// The crates of this workspace, by their tracing targets.
const OWN_CRATES: [&str; 11] = [
    "dstack_shim",
    "shim_components",
    "shim_dcgm",
    "shim_engine",
    "shim_fs",
    "shim_http",
    "shim_resources",
    "shim_runtime",
    "shim_store",
    "shim_task",
    "shim_util",
];

/// `level` for this workspace's crates; the libraries under them (hyper's connection pool
/// logs two lines a Docker request at debug) at `info` at most, unless `level` is `trace`.
/// The dstack server starts every shim at debug (level 5), as it does upstream's, whose
/// debug log has no such lines.
fn own_crates_at(level: LevelFilter) -> anyhow::Result<EnvFilter> {
    let others = if level == LevelFilter::TRACE {
        level
    } else {
        level.min(LevelFilter::INFO)
    };
    OWN_CRATES.iter().try_fold(
        EnvFilter::default().add_directive(others.into()),
        |filter, krate| {
            let directive = format!("{krate}={level}").parse()?;
            Ok(filter.add_directive(directive))
        },
    )
}
