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
use serde::de::{DeserializeOwned, IgnoredAny};
use tokio::sync::mpsc;

use crate::api::{ApiError, ErrorKind};

/// The largest JSON request body accepted (1 MiB); larger ones are answered 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// How long a request's body may take to come whole, where the server did not say
/// ([`crate::ConnectionLimits::body_read_timeout`]).
const DEFAULT_BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The server's [`crate::ConnectionLimits::body_read_timeout`], carried to [`read_body`] in the
/// request's extensions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyReadTimeout(pub std::time::Duration);

/// Reads a request body as one JSON object of type `T`, with the rules and the messages of
/// upstream's decoder (`runner/internal/common/api/api.go`, `DecodeJSONBody`):
///
/// - a `Content-Type` whose media type (gddo's `ParseValueAndParams`: the leading token,
///   lowercased) is not `application/json` is 415; a missing or empty one is accepted;
/// - a body larger than [`MAX_BODY_BYTES`] is 413, whether announced by `Content-Length` or
///   only discovered while streaming;
/// - a body that does not come whole in time is 408
///   ([`crate::ConnectionLimits::body_read_timeout`]);
/// - see [`parse_json`] for the rest (400s).
pub async fn read_json<T, B>(req: http::Request<B>) -> Result<T, ApiError>
where
    T: DeserializeOwned,
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    parse_json(&read_body(req).await?)
}

/// Reads a JSON request body whole: [`read_json`]'s rules but the parsing (415, 413).
pub async fn read_body<B>(req: http::Request<B>) -> Result<Bytes, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    if let Some(ct) = req.headers().get(CONTENT_TYPE)
        && !ct.is_empty()
        && !is_json_media_type(ct.as_bytes())
    {
        return Err(ApiError::new(
            ErrorKind::UnsupportedMediaType,
            "Content-Type header is not application/json",
        ));
    }
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let limit = req
        .extensions()
        .get::<BodyReadTimeout>()
        .map_or(DEFAULT_BODY_READ_TIMEOUT, |t| t.0);
    let collect = Limited::new(req.into_body(), MAX_BODY_BYTES).collect();
    let Ok(collected) = tokio::time::timeout(limit, collect).await else {
        return Err(ApiError::new(
            ErrorKind::RequestTimeout,
            format!("the request body did not come whole within {limit:?}"),
        ));
    };
    let collected = collected.map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            too_large()
        } else {
            ApiError::bad_request(format!("failed to read the request body: {e}"))
        }
    })?;
    Ok(collected.to_bytes())
}

/// Whether a `Content-Type` value names `application/json`, read as gddo's
/// `header.ParseValueAndParams` reads it (upstream's decoder): the leading run of token
/// characters and `/`, lowercased; whatever follows (parameters, a list) is not looked at.
fn is_json_media_type(value: &[u8]) -> bool {
    // RFC 2616 separators; a token is any other visible ASCII character.
    const SEPARATORS: &[u8] = b" \t\"(),/:;<=>?@[]\\{}";
    let media = value
        .iter()
        .take_while(|&&b| b == b'/' || (b > 31 && b < 127 && !SEPARATORS.contains(&b)))
        .count();
    value[..media].eq_ignore_ascii_case(b"application/json")
}

fn too_large() -> ApiError {
    ApiError::new(
        ErrorKind::PayloadTooLarge,
        "Request body must not be larger than 1MB",
    )
}

/// Parses `bytes` as one JSON value of type `T` as upstream's decoder does (Go's
/// `json.Decoder`, messages of `DecodeJSONBody`):
///
/// - nothing but whitespace: `Request body must not be empty`;
/// - a syntax error in the first value: `Request body contains badly-formed JSON (at position
///   N)`, N the bytes read up to the offending one included, or without the position when the
///   body ends inside the value;
/// - `null` is an empty request (every field at its default);
/// - a value `T` does not take: `Request body contains an invalid value for the "F" field (at
///   position N)`, `F` the field's path (`volumes.0.init_fs`, `""` for the body itself), N the
///   byte offset after the value from the body's first non-blank byte; where this shim refuses a value Go would take (a task id
///   that cannot name a directory), its reason follows after `: `;
/// - more than one value: `Request body must only contain a single JSON object`.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let Some(start) = bytes.iter().position(|b| !b.is_ascii_whitespace()) else {
        return Err(ApiError::bad_request("Request body must not be empty"));
    };
    // Go reads (and so checks the syntax of) the whole first value before it looks at types.
    let mut values = serde_json::Deserializer::from_slice(bytes).into_iter::<IgnoredAny>();
    if let Some(Err(e)) = values.next() {
        return Err(syntax_error(bytes, &e));
    }
    let end = values.byte_offset();
    let first = &bytes[..end];
    let parsed = match bytes[start] {
        b'n' => from_json::<T>(b"{}"),
        b'{' => from_json::<T>(first),
        // Go names the body itself `""`; an array is refused on its first byte.
        b'[' => return Err(invalid_value("", 1, None)),
        _ => return Err(invalid_value("", end - start, None)),
    };
    let value = parsed.map_err(|e| match e {
        Refused::Syntax(e) => syntax_error(first, &e),
        Refused::Data { path, error } => {
            let reason = error.to_string();
            let reason = reason
                .rsplit_once(" at line ")
                .map_or(reason.as_str(), |(r, _)| r);
            let go_would_refuse = ["invalid type: ", "invalid value: ", "invalid length "]
                .iter()
                .any(|p| reason.starts_with(p));
            // Go counts from the value's first byte here (from the body's for syntax).
            let offset = offset_of(first, error.line(), error.column()).saturating_sub(start);
            invalid_value(&path, offset, (!go_would_refuse).then_some(reason))
        }
    })?;
    if bytes[end..].iter().any(|b| !b.is_ascii_whitespace()) {
        return Err(ApiError::bad_request(
            "Request body must only contain a single JSON object",
        ));
    }
    Ok(value)
}

enum Refused {
    Syntax(serde_json::Error),
    Data {
        path: String,
        error: serde_json::Error,
    },
}

fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Refused> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = go_path(e.path());
        let error = e.into_inner();
        if error.is_data() {
            Refused::Data { path, error }
        } else {
            Refused::Syntax(error)
        }
    })
}

/// A field's path as Go's `UnmarshalTypeError.Field` spells it: names and indexes joined
/// with `.`.
fn go_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let segments: Vec<String> = path
        .iter()
        .map(|s| match s {
            Segment::Seq { index } => index.to_string(),
            Segment::Map { key } => key.clone(),
            Segment::Enum { variant } => variant.clone(),
            Segment::Unknown => "?".to_owned(),
        })
        .collect();
    segments.join(".")
}

fn syntax_error(bytes: &[u8], e: &serde_json::Error) -> ApiError {
    if e.is_eof() {
        ApiError::bad_request("Request body contains badly-formed JSON")
    } else {
        let mut offset = offset_of(bytes, e.line(), e.column());
        // serde stops before a control character in a string, Go counts it.
        if e.to_string().starts_with("control character") {
            offset += 1;
        }
        ApiError::bad_request(format!(
            "Request body contains badly-formed JSON (at position {offset})"
        ))
    }
}

fn invalid_value(field: &str, offset: usize, reason: Option<&str>) -> ApiError {
    let mut message = format!(
        "Request body contains an invalid value for the {field:?} field (at position {offset})"
    );
    if let Some(reason) = reason {
        message.push_str(": ");
        message.push_str(reason);
    }
    ApiError::bad_request(message)
}

/// The byte offset of serde's 1-based `line` and byte `column` (the last byte read) in
/// `bytes`: the count of bytes read, as Go reports it.
fn offset_of(bytes: &[u8], line: usize, column: usize) -> usize {
    let line_start: usize = bytes
        .split_inclusive(|b| *b == b'\n')
        .take(line.saturating_sub(1))
        .map(<[u8]>::len)
        .sum();
    line_start + column
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

    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    struct T {
        #[allow(dead_code)]
        timeout: u64,
        #[allow(dead_code)]
        v: Vec<V>,
    }

    #[derive(Debug, Default, Deserialize)]
    struct V {
        #[allow(dead_code)]
        #[serde(deserialize_with = "odd")]
        n: u32,
    }

    fn odd<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let n = u32::deserialize(d)?;
        if n % 2 == 1 {
            Ok(n)
        } else {
            Err(serde::de::Error::custom(format!("{n} is even")))
        }
    }

    /// The messages and positions of upstream's decoder, as Go 1.27 answered these bodies
    /// (upstream `runner/internal/common/api/api.go`, `DecodeJSONBody`, served over HTTP).
    #[test]
    fn parse_rules_are_upstreams() {
        assert!(parse_json::<T>(br#" {"timeout":1} "#).is_ok());
        assert!(parse_json::<T>(b"null").is_ok(), "null is an empty request");
        let e = |b: &[u8]| parse_json::<T>(b).unwrap_err().message;
        let bad = |n: u32| format!("Request body contains badly-formed JSON (at position {n})");
        let invalid = |f: &str, n: u32| {
            format!("Request body contains an invalid value for the {f:?} field (at position {n})")
        };
        assert_eq!(e(b""), "Request body must not be empty");
        assert_eq!(e(b"  \n"), "Request body must not be empty");
        assert_eq!(
            e(br#"{"timeout": "#),
            "Request body contains badly-formed JSON"
        );
        assert_eq!(e(br#"{"a":1,"#), "Request body contains badly-formed JSON");
        assert_eq!(e(b"garbage"), bad(1));
        assert_eq!(e(b"  garbage"), bad(3));
        assert_eq!(e(br#"{"timeout":x}"#), bad(12));
        assert_eq!(e(b"\n\n{\"timeout\":x}"), bad(14));
        assert_eq!(e(br#"{"timeout":tru}"#), bad(15));
        assert_eq!(e(br#"{"timeout"  x}"#), bad(13));
        assert_eq!(e(b"{\"t\":\"a\x01\"}"), bad(8));
        assert_eq!(e(br#"{"t":"\q"}"#), bad(8));
        assert_eq!(e(b"\xff"), bad(1));
        assert_eq!(e(b"[1]"), invalid("", 1));
        assert_eq!(e(b"  [1]"), invalid("", 1));
        assert_eq!(e(b"[]"), invalid("", 1));
        assert_eq!(e(br#""x""#), invalid("", 3));
        assert_eq!(e(b"5"), invalid("", 1));
        assert_eq!(e(b"true"), invalid("", 4));
        assert_eq!(e(br#"{"timeout": -1}"#), invalid("timeout", 14));
        assert_eq!(e(b"{\n \"timeout\":\n -1\n}"), invalid("timeout", 17));
        assert_eq!(e(b"\n\n{\"timeout\":\"x\"}"), invalid("timeout", 14));
        assert_eq!(e(br#"{"timeout":1.5}"#), invalid("timeout", 14));
        assert_eq!(e(br#"{"timeout":1e3}"#), invalid("timeout", 14));
        assert_eq!(
            e(br#"{"timeout":18446744073709551616}"#),
            invalid("timeout", 31)
        );
        let single = "Request body must only contain a single JSON object";
        assert_eq!(e(br#"{"timeout":1} x"#), single);
        assert_eq!(e(br#"{"timeout":1}{"#), single);
        assert_eq!(e(br#"{"timeout":1}}"#), single);
        assert_eq!(e(b"{} {}"), single);
        // A type error is reported before trailing data, as Go decodes the first value first.
        assert_eq!(e(br#"{"timeout":"x"} x"#), invalid("timeout", 14));
        // Paths name indexes as Go does; a value this shim refuses where Go would take it
        // carries the reason.
        assert_eq!(e(br#"{"v":[{"n":1},{"n":"x"}]}"#), invalid("v.1.n", 22));
        // (serde's position: one byte further than Go's would be.)
        assert_eq!(
            e(br#"{"v":[{"n":1},{"n":2}]}"#),
            format!("{}: 2 is even", invalid("v.1.n", 21))
        );
    }

    #[test]
    fn media_types_as_gddo_reads_them() {
        for ok in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/json, text/plain",
            "application/json;",
        ] {
            assert!(is_json_media_type(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/jsonx",
            " application/json",
            "json",
        ] {
            assert!(!is_json_media_type(bad.as_bytes()), "{bad}");
        }
    }
}
