//! SIGTERM / SIGINT: the first asks for a graceful shutdown, the second forces it.
//! Containers keep running either way.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// A flag set by SIGTERM or SIGINT whenever one comes, beside [`spawn`]'s handling: it outlives
/// the async runtime, for the upgrade's last look before its exec.
pub fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, flag.clone())?;
    }
    Ok(flag)
}

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
