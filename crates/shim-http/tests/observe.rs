//! The observability routes over real TCP with a fake engine: `GET /api/events` (Server-Sent
//! Events: framing, snapshot first, keep-alives, lagged, slow clients, the client cap, the
//! connection timeouts), `GET /metrics` and `GET /api/ready`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{Resp, Server, parse_response, serve_returns, start_server, stop};
use shim_e2e::harness::{SseEvent, SseParser};
use shim_http::{ConnectionLimits, EventsConfig, FeedError, Readiness};
use shim_task::TaskStatus;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};

/// Every wait is bounded by this (a safety bound, never a timing assertion).
const BOUND: Duration = Duration::from_secs(30);

/// A server over `common`'s fake engine with two tasks, with these events settings.
async fn start(events: EventsConfig) -> Server {
    start_limited(ConnectionLimits::default(), events).await
}

async fn start_limited(limits: ConnectionLimits, events: EventsConfig) -> Server {
    let s = start_server(None, |c| c.with_limits(limits).with_events(events)).await;
    s.engine.insert("a", TaskStatus::Running);
    s.engine.insert("b", TaskStatus::Terminated);
    s
}

/// The default events settings but for the keep-alive period.
fn keep_alive(period: Duration) -> EventsConfig {
    EventsConfig {
        keep_alive: period,
        ..EventsConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// An SSE reader (chunked decoding as it comes).

/// How a stream ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The terminating chunk came: the server ended the answer.
    Cleanly,
    /// The connection closed (or was reset) in the middle of the chunked body.
    Cut,
}

struct Sse {
    reader: BufReader<TcpStream>,
    /// The answer's head (its body is empty).
    head: Resp,
    /// Decoded body bytes not yet parsed into events.
    parser: SseParser,
}

impl Sse {
    async fn connect(addr: SocketAddr) -> Sse {
        Self::over(TcpStream::connect(addr).await.unwrap()).await
    }

    /// Over a connection with a small receive buffer (so a client that stops reading makes
    /// the server's side fill up sooner).
    async fn connect_small_buffer(addr: SocketAddr) -> Sse {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        Self::over(socket.connect(addr).await.unwrap()).await
    }

    async fn over(mut stream: TcpStream) -> Sse {
        let request = b"GET /api/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n";
        stream.write_all(request).await.unwrap();
        let mut reader = BufReader::new(stream);
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let n = bounded(reader.read_until(b'\n', &mut head)).await.unwrap();
            assert!(n > 0, "the connection closed in the head");
        }
        let (head, parser) = (parse_response(&head), SseParser::new());
        Sse {
            reader,
            head,
            parser,
        }
    }

    /// Reads one chunk into the parser; `Err` when the body ends.
    async fn chunk(&mut self) -> Result<(), Ended> {
        let mut line = String::new();
        match bounded(self.reader.read_line(&mut line)).await {
            Ok(0) | Err(_) => return Err(Ended::Cut),
            Ok(_) => {}
        }
        let size = usize::from_str_radix(line.trim_end(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size line {line:?}"));
        if size == 0 {
            line.clear();
            let _ = bounded(self.reader.read_line(&mut line)).await;
            assert_eq!(line, "\r\n", "no trailers are sent");
            return Err(Ended::Cleanly);
        }
        let mut chunk = vec![0; size + 2];
        if bounded(self.reader.read_exact(&mut chunk)).await.is_err() {
            return Err(Ended::Cut);
        }
        assert_eq!(&chunk[size..], b"\r\n");
        self.parser.push(&chunk[..size]);
        Ok(())
    }

    /// The next event or comment (a comment is always a keep-alive); `Err` when the stream
    /// ends first.
    async fn next(&mut self) -> Result<SseEvent, Ended> {
        loop {
            if let Some(block) = self.parser.next_block() {
                let event = block.unwrap_or_else(|e| panic!("{e}"));
                if event.is_comment() {
                    assert_eq!(event.data, " keep-alive", "{event:?}");
                }
                return Ok(event);
            }
            self.chunk().await?;
        }
    }

    /// The next event that is not a comment.
    async fn next_event(&mut self) -> Result<SseEvent, Ended> {
        loop {
            let event = self.next().await?;
            if !event.is_comment() {
                return Ok(event);
            }
        }
    }

    /// Reads until the stream ends (bounded as a whole: keep-alives would go on forever),
    /// returning how; events in between are dropped.
    async fn until_end(&mut self) -> Ended {
        let end = tokio::time::timeout(BOUND, async {
            loop {
                if let Err(end) = self.next().await {
                    return end;
                }
            }
        });
        end.await.expect("the stream ended within the bound")
    }
}

async fn bounded<T>(f: impl Future<Output = std::io::Result<T>>) -> std::io::Result<T> {
    let answered = tokio::time::timeout(BOUND, f).await;
    answered.expect("the server answered within the bound")
}

fn event(event: &str, id: Option<u64>, data: impl Into<String>) -> SseEvent {
    let (event, data) = (event.into(), data.into());
    SseEvent { event, id, data }
}

fn change_json(seq: u64, task: &str, pad: usize) -> String {
    serde_json::json!({"seq": seq, "task": task, "change": "status", "status": "running",
        "pad": "x".repeat(pad)})
    .to_string()
}

/// Waits (bounded) until `f` holds, checking every few milliseconds.
async fn eventually(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let found = tokio::time::timeout(BOUND, async {
        while !f().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert!(found.await.is_ok(), "never: {what}");
}

/// Subscribed: the snapshot has been read, so changes sent from now on reach the client.
async fn subscribed(addr: SocketAddr) -> Sse {
    let mut sse = Sse::connect(addr).await;
    assert_eq!(sse.head.status, 200);
    assert_eq!(sse.next_event().await.unwrap().event, "snapshot");
    sse
}

// ---------------------------------------------------------------------------------------------
// Events

/// The answer's head, the snapshot first (what the list says, no id), then each change with
/// its sequence number as the id, in order; a graceful shutdown ends the stream cleanly and
/// the server stops.
#[tokio::test]
async fn events_snapshot_first_then_changes_in_order() {
    let s = start(EventsConfig::default()).await;
    let mut sse = Sse::connect(s.addr).await;
    assert_eq!(sse.head.status, 200);
    assert_eq!(sse.head.header("content-type"), Some("text/event-stream"));
    assert_eq!(sse.head.header("cache-control"), Some("no-cache"));
    assert_eq!(sse.head.header("transfer-encoding"), Some("chunked"));

    let tasks = r#"{"tasks":[{"id":"a","status":"running"},{"id":"b","status":"terminated"}]}"#;
    assert_eq!(sse.next().await.unwrap(), event("snapshot", None, tasks));
    for seq in 1..=3 {
        s.engine.send(seq, change_json(seq, "a", 0));
    }
    // A value with a line break (not what serde_json writes, but any JSON a feed gives) is
    // sent as several data lines and read back whole.
    s.engine.send(4, "{\"a\":\n1}");
    for seq in 1..=3 {
        let change = event("change", Some(seq), change_json(seq, "a", 0));
        assert_eq!(sse.next().await.unwrap(), change);
    }
    assert_eq!(sse.next().await.unwrap().data, "{\"a\":\n1}");

    s.shutdown.cancel();
    assert_eq!(sse.until_end().await, Ended::Cleanly);
    // serve returns although the client keeps its stream open.
    serve_returns(s.handle).await;
}

/// A keep-alive comment is sent every keep-alive period.
#[tokio::test]
async fn events_keep_alive_comments() {
    let s = start(keep_alive(Duration::from_millis(50))).await;
    let mut sse = subscribed(s.addr).await;
    for _ in 0..3 {
        assert_eq!(sse.next().await.unwrap().event, ":");
    }
    stop(s).await;
}

/// The connection's idle and header-read timeouts do not close a stream in progress, even
/// one on which nothing is sent for many times those timeouts.
#[tokio::test]
async fn events_outlive_the_connection_timeouts() {
    let limits = ConnectionLimits {
        header_read_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_millis(200),
        ..ConnectionLimits::default()
    };
    let s = start_limited(limits, keep_alive(Duration::from_secs(3600))).await;
    let mut sse = subscribed(s.addr).await;
    // Silence on the connection, longer than both timeouts (a lower bound: a slow machine
    // only makes it longer).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.engine.send(1, change_json(1, "a", 0));
    let event = sse.next().await.expect("the stream is still open");
    assert_eq!((event.event.as_str(), event.id), ("change", Some(1)));
    stop(s).await;
}

/// A feed error ends the stream cleanly after the changes before it, and a reconnect gets a
/// new snapshot: a feed that fell behind first sends `event: lagged` with the number
/// missed; a feed whose producer closed sends nothing more.
#[tokio::test]
async fn events_end_on_a_lagged_or_closed_feed() {
    let lagged = event("lagged", None, r#"{"missed":17}"#);
    for (name, error, last) in [
        ("lagged", FeedError::Lagged { missed: 17 }, Some(lagged)),
        ("closed", FeedError::Closed, None),
    ] {
        let s = start(EventsConfig::default()).await;
        let mut sse = subscribed(s.addr).await;
        s.engine.send(1, change_json(1, "a", 0));
        s.engine.changes.send(Err(error)).unwrap();
        assert_eq!(sse.next().await.unwrap().id, Some(1), "{name}");
        if let Some(last) = last {
            assert_eq!(sse.next().await.unwrap(), last, "{name}");
        }
        assert_eq!(sse.until_end().await, Ended::Cleanly, "{name}");
        let _again = subscribed(s.addr).await;
        stop(s).await;
    }
}

/// A client that stops reading while changes pour in: a client that reads gets every change
/// in order meanwhile, and the stalled client is disconnected (the body cut off, no clean
/// end) once its queue is full. Then the server still answers and the stalled client's place
/// is free again.
#[tokio::test]
async fn a_slow_client_is_disconnected_when_its_queue_is_full() {
    // Only the queue limit can catch it.
    let max_queued_bytes = 64 * 1024;
    slow_client_is_disconnected(Duration::from_secs(3600), max_queued_bytes).await;
}

/// As above, caught by the other check: frames waiting a whole keep-alive period without
/// the connection taking any (the queue limit is too large to be reached).
#[tokio::test]
async fn a_stalled_client_is_disconnected_after_a_keep_alive_period() {
    slow_client_is_disconnected(Duration::from_secs(1), 1 << 30).await;
}

/// The two tests above, with a cap of 2 streams.
async fn slow_client_is_disconnected(keep_alive: Duration, max_queued_bytes: usize) {
    const PAD: usize = 4096;
    let events = EventsConfig {
        max_clients: 2,
        keep_alive,
        max_queued_bytes,
    };
    let s = start(events).await;
    let mut stalled = Sse::connect_small_buffer(s.addr).await;
    assert_eq!(stalled.next_event().await.unwrap().event, "snapshot");
    let mut reader = subscribed(s.addr).await;

    // Changes of 4 KiB pour in until the stalled client is disconnected, however much the
    // kernel and hyper buffer for it on this machine (its place under the cap of 2 comes
    // free: a probe stream is then accepted). The producer keeps at most a few changes ahead
    // of the reading client, so only the stalled one can fall behind, however the machine
    // schedules the test.
    let received = Arc::new(AtomicU64::new(0));
    let last = Arc::new(AtomicU64::new(u64::MAX));
    let reading = {
        let (received, last) = (received.clone(), last.clone());
        tokio::spawn(async move {
            let mut seq = 0;
            while seq < last.load(Ordering::Acquire) {
                let event = reader.next_event().await.unwrap();
                seq += 1;
                let got = (event.event.as_str(), event.id);
                let in_order = "the reading client gets every change in order";
                assert_eq!(got, ("change", Some(seq)), "{in_order}");
                received.store(seq, Ordering::Release);
            }
            reader
        })
    };
    let produced = tokio::time::timeout(BOUND, async {
        let mut seq = 0;
        loop {
            seq += 1;
            while seq > received.load(Ordering::Acquire) + 4 {
                tokio::task::yield_now().await;
            }
            let freed = seq % 64 == 0 && Sse::connect(s.addr).await.head.status == 200;
            if freed {
                // The last change: the reader stops after it.
                last.store(seq, Ordering::Release);
            }
            s.engine.send(seq, change_json(seq, "a", PAD));
            tokio::task::yield_now().await;
            if freed {
                return seq;
            }
        }
    })
    .await;
    let sent = produced.expect("the stalled client was disconnected while changes poured in");
    let reader = tokio::time::timeout(BOUND, reading)
        .await
        .expect("the reading client got every change")
        .unwrap();
    assert!(sent > 0);

    // The stalled client now reads: what was in flight, then the cut.
    let end = stalled.until_end().await;
    assert_eq!(end, Ended::Cut, "the stalled client was disconnected");

    assert_eq!(s.get("/api/ready").await.status, 200);
    // Its place under the cap (2) is free again: the reader and one more.
    eventually("the stalled client's place is given back", async || {
        Sse::connect(s.addr).await.head.status == 200
    })
    .await;
    drop(reader);
    stop(s).await;
}

/// At most `max_clients` streams: more are answered 503; a closed stream's place is given
/// back.
#[tokio::test]
async fn events_client_cap() {
    let s = start(EventsConfig {
        max_clients: 2,
        ..EventsConfig::default()
    })
    .await;
    let first = subscribed(s.addr).await;
    let _second = subscribed(s.addr).await;
    let r = s.get("/api/events").await;
    r.assert_error(503, "too many event streams (at most 2); try again later");
    // Other routes are unaffected.
    assert_eq!(s.get("/api/healthcheck").await.status, 200);

    drop(first);
    eventually("a closed stream's place is given back", async || {
        let mut sse = Sse::connect(s.addr).await;
        sse.head.status == 200 && sse.next_event().await.is_ok_and(|e| e.event == "snapshot")
    })
    .await;
    stop(s).await;
}

// ---------------------------------------------------------------------------------------------
// Metrics and readiness

/// `GET /metrics`: the text as given, as OpenMetrics. Without metrics, or without a change
/// feed (`subscribe` answering `NotFound`), `GET /metrics` and `GET /api/events` answer 404
/// with the message (the trait's defaults are run by the crate README's example).
#[tokio::test]
async fn metrics_route_and_content_type() {
    let s = start(EventsConfig::default()).await;
    s.get("/metrics").await.assert_answer(
        200,
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "# TYPE x counter\nx_total 1\n# EOF\n",
    );
    // The task metrics route is still there, and distinct.
    assert_eq!(s.get("/metrics/tasks/a").await.status, 404);

    s.engine.plain.store(true, Ordering::SeqCst);
    s.assert_refusals(&[
        "no_metrics: GET /metrics => 404 metrics are not available",
        "no_feed: GET /api/events => 404 task change events are not available",
    ])
    .await;
    stop(s).await;
}

/// `GET /api/ready`: 200 with the readiness when ready, 503 with the same shape and the
/// reasons when not (the trait's default, ready, is run by the crate README's example).
#[tokio::test]
async fn readiness_200_and_503() {
    let s = start(EventsConfig::default()).await;
    let ready = "{\"ready\":true,\"reasons\":[]}\n";
    let r = s.get("/api/ready").await;
    r.assert_answer(200, Some("application/json"), ready);

    let reason = "Docker's event stream is disconnected";
    let not_ready =
        Readiness::new(false, vec![reason.into()]).with_runtime(false, Some(1.5), 600.0);
    *s.engine.readiness.lock().unwrap() = not_ready;
    let r = s.get("/api/ready").await;
    assert_eq!(r.status, 503);
    assert_eq!(
        r.json(),
        serde_json::json!({"ready": false, "reasons": [reason], "events_connected": false,
            "last_reconcile_age_seconds": 1.5, "reconcile_max_age_seconds": 600.0})
    );
    // The healthcheck says only that the process answers.
    assert_eq!(s.get("/api/healthcheck").await.status, 200);
    stop(s).await;
}
