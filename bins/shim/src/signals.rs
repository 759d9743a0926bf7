//! SIGTERM / SIGINT: the first asks for a graceful shutdown, the second forces it.
//! Containers keep running either way.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Listens for SIGTERM and SIGINT in the background.
pub fn spawn(graceful: CancellationToken, force: CancellationToken) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let mut seen = 0;
        loop {
            let name = tokio::select! {
                Some(()) = term.recv() => "SIGTERM",
                Some(()) = int.recv() => "SIGINT",
                else => return,
            };
            seen += 1;
            if seen == 1 {
                tracing::info!(signal = name, "shutting down gracefully (again to force)");
                graceful.cancel();
            } else {
                tracing::warn!(signal = name, "forcing shutdown");
                force.cancel();
                return;
            }
        }
    });
    Ok(())
}
