//! Event streams as the bench reads them: each event stamped with when the bench received it,
//! waited for with a bound. Two sources feed one: the shim's `GET /api/events` (Server-Sent
//! Events, read by a thread over the harness's HTTP client, [`Events::sse`]) and Docker's
//! `/events` (bollard, [`super::raw::Docker::events`]).

use std::io::Read;
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Result, bail};
use serde_json::Value;
use shim_e2e::harness::{SseParser, Streamed};

/// The events of a subscription, each with when it was received. Dropping it ends the
/// subscription (closes its connection, ends its reader).
pub struct Events<T = Value> {
    rx: mpsc::Receiver<(T, SystemTime)>,
    /// Ends the reader: run once, on drop.
    close: Option<Box<dyn FnOnce() + Send>>,
}

impl<T> Events<T> {
    /// The events a reader sends on `rx`; `close` ends that reader.
    pub fn new(rx: mpsc::Receiver<(T, SystemTime)>, close: impl FnOnce() + Send + 'static) -> Self {
        Self {
            rx,
            close: Some(Box::new(close)),
        }
    }

    /// The next event, if one comes within `limit`.
    pub fn next(&self, limit: Duration) -> Result<Option<(T, SystemTime)>> {
        match self.rx.recv_timeout(limit) {
            Ok(event) => Ok(Some(event)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the event stream ended"),
        }
    }

    /// The next event `wanted` accepts (others are skipped), within `limit`.
    pub fn wait_until(
        &self,
        limit: Duration,
        wanted: impl Fn(&T) -> bool,
    ) -> Result<(T, SystemTime)> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((event, at)) if wanted(&event) => return Ok((event, at)),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => bail!("no such event within {limit:?}"),
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the event stream ended"),
            }
        }
    }
}

impl Events<Value> {
    /// Checks that the answer to `GET path` is 200 and starts a thread that reads its body's
    /// Server-Sent Events (the JSON of each `data:`), stamping each when it arrives.
    pub fn sse(streamed: Streamed<TcpStream>, path: &str) -> Result<Self> {
        anyhow::ensure!(
            streamed.status == 200,
            "GET {path} answered {}",
            streamed.status
        );
        // A handle on the same socket: shutting it down ends the reader thread's blocking read.
        let socket = streamed.body.get_ref().get_ref().try_clone()?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || read_sse(streamed.body, &tx));
        Ok(Self::new(rx, move || {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }))
    }
}

impl<T> Drop for Events<T> {
    fn drop(&mut self) {
        if let Some(close) = self.close.take() {
            close();
        }
    }
}

/// Reads Server-Sent Events (chunked transfer decoded by the harness) until the stream ends,
/// each stamped with when its last byte was read.
fn read_sse(mut body: impl Read, tx: &mpsc::Sender<(Value, SystemTime)>) {
    let mut sse = SseParser::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let at = SystemTime::now();
        sse.push(&buf[..n]);
        while let Some(block) = sse.next_block() {
            if let Ok(event) = block
                && !event.is_comment()
                && let Ok(value) = serde_json::from_str::<Value>(&event.data)
                && tx.send((value, at)).is_err()
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn events_are_waited_for_and_the_reader_is_closed_on_drop() {
        let (tx, rx) = mpsc::channel();
        let closed = Arc::new(AtomicBool::new(false));
        let events = {
            let closed = closed.clone();
            Events::new(rx, move || closed.store(true, Ordering::Relaxed))
        };
        let at = SystemTime::now();
        for i in 0..3 {
            tx.send((i, at)).unwrap();
        }
        assert_eq!(
            events
                .wait_until(Duration::from_secs(1), |e| *e == 1)
                .unwrap(),
            (1, at)
        );
        assert_eq!(events.next(Duration::ZERO).unwrap(), Some((2, at)));
        assert_eq!(events.next(Duration::from_millis(1)).unwrap(), None);
        assert!(
            events
                .wait_until(Duration::from_millis(1), |_| true)
                .is_err()
        );
        drop(tx);
        assert!(events.next(Duration::ZERO).is_err());
        assert!(!closed.load(Ordering::Relaxed));
        drop(events);
        assert!(closed.load(Ordering::Relaxed));
    }

    #[test]
    fn sse_data_is_read_as_json_and_comments_are_skipped() {
        let body: &[u8] = b":{\"task\":\"comment\"}\n\ndata: {\"task\":\"a\"}\n\ndata: not json\n\ndata: {\"task\":\"b\"}\n\n";
        let (tx, rx) = mpsc::channel();
        read_sse(body, &tx);
        let tasks: Vec<Value> = rx.try_iter().map(|(v, _)| v["task"].clone()).collect();
        assert_eq!(tasks, ["a", "b"]);
    }
}
