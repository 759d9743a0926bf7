//! `GET /api/events`: task changes as Server-Sent Events.
//!
//! Each client gets a forwarder task that takes changes from its [`ChangeFeed`] (the engine
//! never waits for it: a feed that falls behind says so) and queues SSE frames for the
//! response body ([`ResponseBody::stream`]). The queue is bounded in bytes; a client that
//! does not take what it is sent — the queue is full, or frames have waited a whole
//! keep-alive period without the connection taking any — is disconnected (the connection is
//! closed, the chunked body left unterminated), so a slow client costs the shim at most the
//! queue and never slows the engine or other clients.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::api::{ApiError, ChangeEvent, ChangeFeed, FeedError};
use crate::body::{PushError, ResponseBody, StreamSink};

/// Limits of `GET /api/events`; see [`EventsConfig::default`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventsConfig {
    /// At most this many event streams at once; more are answered 503.
    pub max_clients: usize,
    /// A comment line (`: keep-alive`) is sent this often, so proxies and clients see a live
    /// connection; also the period of the stalled-client check. Taken as 10 ms at least and
    /// a day at most.
    pub keep_alive: Duration,
    /// At most about this many bytes of frames wait for one client; a client that lets more
    /// pile up is disconnected.
    pub max_queued_bytes: usize,
}

impl Default for EventsConfig {
    /// 64 clients, a keep-alive every 15 s, 1 MiB queued per client.
    fn default() -> Self {
        Self {
            max_clients: 64,
            keep_alive: Duration::from_secs(15),
            max_queued_bytes: 1024 * 1024,
        }
    }
}

/// The event streams being served (for the cap).
#[derive(Debug)]
pub(crate) struct EventsHub {
    config: EventsConfig,
    active: Arc<AtomicUsize>,
}

/// One client's place under the cap, given back when dropped.
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl EventsHub {
    pub(crate) fn new(config: EventsConfig) -> Self {
        Self {
            config,
            active: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn try_acquire(&self) -> Option<Slot> {
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.config.max_clients).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(self.active.clone()))
    }
}

/// The connection's close switch, put into each request's extensions by the server: the
/// forwarder pulls it to disconnect a client that does not keep up.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionClose(pub CancellationToken);

#[derive(Serialize)]
struct Missed {
    missed: u64,
}

/// `event: <event>`, then `id: <id>` if any, then the data (one `data:` line per line), then
/// the blank line that ends the event.
fn frame(event: &str, id: Option<u64>, data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + 32);
    out.push_str("event: ");
    out.push_str(event);
    out.push('\n');
    if let Some(id) = id {
        out.push_str("id: ");
        out.push_str(&id.to_string());
        out.push('\n');
    }
    for line in data.split('\n') {
        out.push_str("data: ");
        out.push_str(line.strip_suffix('\r').unwrap_or(line));
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

/// Starts an event stream: takes a place under the cap (503 beyond it), subscribes, then
/// queues the snapshot (`snapshot_json`, taken by `snapshot` after subscribing) and spawns the
/// forwarder. Returns the body to answer with.
pub(crate) async fn start<F, Fut>(
    hub: &EventsHub,
    subscribe: impl FnOnce() -> Result<Box<dyn ChangeFeed>, ApiError>,
    snapshot: F,
    shutdown: CancellationToken,
    close: Option<ConnectionClose>,
) -> Result<ResponseBody, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<String, ApiError>>,
{
    let slot = hub.try_acquire().ok_or_else(|| {
        ApiError::unavailable(format!(
            "too many event streams (at most {}); try again later",
            hub.config.max_clients
        ))
    })?;
    // Subscribe first: no change falls between the snapshot and the first change.
    let feed = subscribe()?;
    let snapshot = snapshot().await?;
    let (body, sink) = ResponseBody::stream(hub.config.max_queued_bytes);
    // An empty queue always accepts a frame.
    let _ = sink.push(frame("snapshot", None, &snapshot));
    tokio::spawn(forward(
        feed,
        sink,
        slot,
        hub.config.keep_alive,
        shutdown,
        close.map(|c| c.0),
    ));
    Ok(body)
}

/// Why a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    ClientGone,
    Shutdown,
    FeedClosed,
    Lagged,
    TooSlow,
}

async fn forward(
    mut feed: Box<dyn ChangeFeed>,
    sink: StreamSink,
    slot: Slot,
    keep_alive: Duration,
    shutdown: CancellationToken,
    close: Option<CancellationToken>,
) {
    // A zero period panics tokio's interval, one past the clock's range its `Instant`.
    let keep_alive = keep_alive.clamp(Duration::from_millis(10), Duration::from_secs(86_400));
    let mut tick = tokio::time::interval_at(Instant::now() + keep_alive, keep_alive);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // (taken, pushed) at the last keep-alive: frames that were already waiting then and of
    // which the connection has taken none since mean a client that stopped reading.
    let mut last = (sink.taken(), sink.pushed());
    let end = loop {
        let pushed = tokio::select! {
            biased;
            () = shutdown.cancelled() => break End::Shutdown,
            () = sink.closed() => break End::ClientGone,
            _ = tick.tick() => {
                let taken = sink.taken();
                if taken == last.0 && last.1 > last.0 {
                    break End::TooSlow;
                }
                last = (taken, sink.pushed());
                sink.push(KEEP_ALIVE)
            }
            got = feed.recv() => match got {
                Ok(ChangeEvent { seq, json }) => sink.push(frame("change", Some(seq), &json)),
                Err(FeedError::Lagged { missed }) => {
                    let data = serde_json::to_string(&Missed { missed })
                        .unwrap_or_else(|_| format!("{{\"missed\":{missed}}}"));
                    // If even this does not fit, the client is too slow anyway.
                    break match sink.push(frame("lagged", None, &data)) {
                        Ok(()) => End::Lagged,
                        Err(PushError::Full) => End::TooSlow,
                        Err(PushError::Closed) => End::ClientGone,
                    };
                }
                Err(FeedError::Closed) => break End::FeedClosed,
            },
        };
        match pushed {
            Ok(()) => {}
            Err(PushError::Full) => break End::TooSlow,
            Err(PushError::Closed) => break End::ClientGone,
        }
    };
    match end {
        End::TooSlow => {
            tracing::warn!(
                "an event stream client does not read what it is sent: disconnecting it"
            );
            // Close the connection itself: the client may not read the end of the body.
            if let Some(close) = close {
                close.cancel();
            }
        }
        End::Lagged => tracing::info!("an event stream fell behind the engine: ending it"),
        other => tracing::debug!(end = ?other, "an event stream ended"),
    }
    // The body ends once what is queued has been sent (or is dropped with the connection).
    drop(sink);
    drop(slot);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames() {
        assert_eq!(
            frame("change", Some(7), r#"{"a":1}"#),
            Bytes::from_static(b"event: change\nid: 7\ndata: {\"a\":1}\n\n")
        );
        assert_eq!(
            frame("lagged", None, "a\nb\r\nc"),
            Bytes::from_static(b"event: lagged\ndata: a\ndata: b\ndata: c\n\n")
        );
    }

    #[test]
    fn the_cap_counts_live_slots() {
        let hub = EventsHub::new(EventsConfig {
            max_clients: 2,
            ..EventsConfig::default()
        });
        let a = hub.try_acquire().unwrap();
        let _b = hub.try_acquire().unwrap();
        assert!(hub.try_acquire().is_none());
        drop(a);
        assert!(hub.try_acquire().is_some());
    }
}
