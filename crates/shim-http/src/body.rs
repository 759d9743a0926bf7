//! Request bodies in (JSON with limits) and response bodies out (complete, or streamed
//! through a bounded queue).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, SizeHint};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::api::{ApiError, ErrorKind};

/// The largest JSON request body accepted (1 MiB); larger ones are answered 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Reads a request body as one JSON object of type `T`.
///
/// - a `Content-Type` other than `application/json` (parameters allowed) is 415; a missing one
///   is accepted, as dstack's Go shim does;
/// - a body larger than [`MAX_BODY_BYTES`] is 413, whether announced by `Content-Length` or
///   only discovered while streaming;
/// - an empty body, anything but a single JSON object, malformed JSON, trailing data, or a
///   value serde rejects is 400 with serde's message.
pub async fn read_json<T, B>(req: http::Request<B>) -> Result<T, ApiError>
where
    T: DeserializeOwned,
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    if let Some(ct) = req.headers().get(CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("<non-ascii>");
        let media = ct.split(';').next().unwrap_or("").trim();
        if !media.eq_ignore_ascii_case("application/json") {
            return Err(ApiError::new(
                ErrorKind::UnsupportedMediaType,
                format!("Content-Type must be application/json, got {ct:?}"),
            ));
        }
    }
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let collected = Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large()
            } else {
                ApiError::bad_request(format!("failed to read the request body: {e}"))
            }
        })?;
    parse_json(&collected.to_bytes())
}

fn too_large() -> ApiError {
    ApiError::new(
        ErrorKind::PayloadTooLarge,
        format!("request body must not be larger than {MAX_BODY_BYTES} bytes"),
    )
}

/// Parses `bytes` as exactly one JSON object of type `T` (see [`read_json`] for the rules).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        None => Err(ApiError::bad_request("request body must not be empty")),
        Some(b'{') => serde_json::from_slice(bytes)
            .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"))),
        Some(_) => Err(ApiError::bad_request(
            "request body must be a single JSON object",
        )),
    }
}

type OnDone = Box<dyn FnOnce() + Send + Sync>;

/// A response body: complete, or a stream of frames fed by a [`StreamSink`]. It can run a
/// hook once hyper is done with it (used to start a shutdown only after its own 200 has been
/// written) and hold guards that live exactly as long as the response is being written.
pub struct ResponseBody {
    kind: Kind,
    on_done: Option<OnDone>,
    guards: Vec<Box<dyn Send + Sync>>,
}

enum Kind {
    Full(Option<Bytes>),
    Stream(StreamSource),
}

impl ResponseBody {
    /// A body holding `data`.
    pub fn new(data: impl Into<Bytes>) -> Self {
        Self {
            kind: Kind::Full(Some(data.into())),
            on_done: None,
            guards: Vec::new(),
        }
    }

    /// An empty body.
    pub fn empty() -> Self {
        Self::new(Bytes::new())
    }

    /// A streaming body and the sink that feeds it. At most about `max_queued_bytes` wait in
    /// the queue between the two (see [`StreamSink::push`]); the body ends once the sink is
    /// dropped and what it queued has been sent.
    pub fn stream(max_queued_bytes: usize) -> (Self, StreamSink) {
        let (tx, rx) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::default());
        let body = Self {
            kind: Kind::Stream(StreamSource {
                rx,
                counters: counters.clone(),
            }),
            on_done: None,
            guards: Vec::new(),
        };
        let sink = StreamSink {
            tx,
            counters,
            max_queued_bytes,
        };
        (body, sink)
    }

    /// Runs `f` when the body is dropped, i.e. once it has been written (or the connection
    /// is gone).
    #[must_use]
    pub fn on_done(mut self, f: impl FnOnce() + Send + Sync + 'static) -> Self {
        self.on_done = Some(Box::new(f));
        self
    }

    /// Keeps `guard` alive until the body is dropped.
    pub fn hold(&mut self, guard: impl Send + Sync + 'static) {
        self.guards.push(Box::new(guard));
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        if let Some(f) = self.on_done.take() {
            f();
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().kind {
            Kind::Full(data) => Poll::Ready(
                data.take()
                    .filter(|d| !d.is_empty())
                    .map(|d| Ok(Frame::data(d))),
            ),
            Kind::Stream(source) => source.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(data) => data.as_ref().is_none_or(Bytes::is_empty),
            Kind::Stream(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(data) => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Kind::Stream(_) => SizeHint::default(),
        }
    }
}

/// What the two ends of a stream count (frames and bytes pushed and taken).
#[derive(Debug, Default)]
struct Counters {
    queued_bytes: AtomicUsize,
    pushed: AtomicU64,
    taken: AtomicU64,
}

struct StreamSource {
    rx: mpsc::UnboundedReceiver<Bytes>,
    counters: Arc<Counters>,
}

impl StreamSource {
    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(frame)) => {
                self.counters
                    .queued_bytes
                    .fetch_sub(frame.len(), Ordering::AcqRel);
                self.counters.taken.fetch_add(1, Ordering::AcqRel);
                Poll::Ready(Some(Ok(Frame::data(frame))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Why [`StreamSink::push`] did not queue a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// The queue holds its limit already: the connection does not take what it is sent.
    #[error("the client does not read fast enough")]
    Full,
    /// The body is gone (the response ended or the connection closed).
    #[error("the client is gone")]
    Closed,
}

/// The producing end of a streaming [`ResponseBody`].
#[derive(Debug)]
pub struct StreamSink {
    tx: mpsc::UnboundedSender<Bytes>,
    counters: Arc<Counters>,
    max_queued_bytes: usize,
}

impl StreamSink {
    /// Queues `frame`. Never waits: when the frames queued and not yet taken by the connection
    /// would exceed the limit it is [`PushError::Full`] (a frame is always accepted by an empty
    /// queue, so the queue holds at most the limit plus one frame).
    pub fn push(&self, frame: impl Into<Bytes>) -> Result<(), PushError> {
        let frame = frame.into();
        let queued = self.counters.queued_bytes.load(Ordering::Acquire);
        if queued > 0 && queued.saturating_add(frame.len()) > self.max_queued_bytes {
            return Err(PushError::Full);
        }
        self.counters
            .queued_bytes
            .fetch_add(frame.len(), Ordering::AcqRel);
        self.counters.pushed.fetch_add(1, Ordering::AcqRel);
        self.tx.send(frame).map_err(|_| PushError::Closed)
    }

    /// Frames pushed so far.
    pub fn pushed(&self) -> u64 {
        self.counters.pushed.load(Ordering::Acquire)
    }

    /// Frames the connection has taken so far.
    pub fn taken(&self) -> u64 {
        self.counters.taken.load(Ordering::Acquire)
    }

    /// Resolves once the body is gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct T {
        #[allow(dead_code)]
        a: u32,
    }

    #[test]
    fn parse_rules() {
        assert!(parse_json::<T>(br#" {"a":1} "#).is_ok());
        let e = |b: &[u8]| parse_json::<T>(b).unwrap_err().message;
        assert_eq!(e(b""), "request body must not be empty");
        assert_eq!(e(b"  \n"), "request body must not be empty");
        assert_eq!(e(b"[1]"), "request body must be a single JSON object");
        assert_eq!(e(b"null"), "request body must be a single JSON object");
        assert_eq!(
            e(br#"{"a":1} {"a":2}"#),
            "invalid request body: trailing characters at line 1 column 9"
        );
        assert_eq!(
            e(br#"{"a":"x"}"#),
            "invalid request body: invalid type: string \"x\", expected u32 at line 1 column 8"
        );
        assert_eq!(
            e(br#"{"#),
            "invalid request body: EOF while parsing an object at line 1 column 1"
        );
    }
}
