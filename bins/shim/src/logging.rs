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
    let filter = EnvFilter::builder()
        .with_default_directive(level.into())
        .from_env()
        .context("invalid RUST_LOG")?;
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
