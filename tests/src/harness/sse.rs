//! Server-Sent Events as the shim's `GET /api/events` sends them: the one parser of the
//! workspace's tests and the bench. It works on decoded body bytes as they arrive (the HTTP
//! client decodes the chunked transfer), so blocking and async readers share it; and the
//! tests' blocking client of the stream ([`EventStream`]).

use std::io::{self, BufReader, Read as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::http::{Body, Request};

/// One SSE block: an event (`event:`, `id:`, `data:` lines; multi-line data joined by `\n`), or
/// a comment (`event` is `":"`, `data` the comment's text after the colon).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event's type (`snapshot`, `change`, `lagged`, ...), or `":"` for a comment.
    pub event: String,
    /// The `id:` field, if the block had one.
    pub id: Option<u64>,
    /// The data, its lines joined by `\n`.
    pub data: String,
}

impl SseEvent {
    /// Whether the block was a comment (keep-alives are).
    pub fn is_comment(&self) -> bool {
        self.event == ":"
    }
}

/// Splits decoded body bytes into blocks (ended by a blank line) as they arrive.
#[derive(Debug, Default)]
pub struct SseParser {
    pending: Vec<u8>,
}

impl SseParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read from the body.
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// The next complete block, parsed; `None` until one has arrived whole.
    pub fn next_block(&mut self) -> Option<Result<SseEvent, String>> {
        let end = self.pending.windows(2).position(|w| w == b"\n\n")?;
        let block: Vec<u8> = self.pending.drain(..end + 2).collect();
        Some(match String::from_utf8(block) {
            Ok(block) => parse_block(block.trim_end_matches('\n')),
            Err(e) => Err(format!("an event block that is not UTF-8: {e}")),
        })
    }
}

/// Parses one block (without its closing blank line), strictly: every line must be a field the
/// shim sends (`event:`, `id:`, `data:`) or a comment.
pub fn parse_block(block: &str) -> Result<SseEvent, String> {
    let mut event = SseEvent {
        event: String::new(),
        id: None,
        data: String::new(),
    };
    let mut data = Vec::new();
    for line in block.split('\n') {
        if let Some(comment) = line.strip_prefix(':') {
            event.event = ":".to_owned();
            data.push(comment);
        } else if let Some(v) = line.strip_prefix("event: ") {
            event.event = v.to_owned();
        } else if let Some(v) = line.strip_prefix("id: ") {
            event.id = Some(v.parse().map_err(|e| format!("bad id {v:?}: {e}"))?);
        } else if let Some(v) = line.strip_prefix("data: ") {
            data.push(v);
        } else {
            return Err(format!("unexpected line {line:?} in {block:?}"));
        }
    }
    event.data = data.join("\n");
    Ok(event)
}

/// A blocking client of `GET /api/events`, the chunked transfer decoded as it comes.
pub struct EventStream {
    body: Body<BufReader<TcpStream>>,
    parser: SseParser,
}

impl EventStream {
    /// Connects to the shim at `addr` and checks the answer's head (200, `text/event-stream`,
    /// chunked); the snapshot is the next event. A read waits at most `silence` (keep-alives
    /// come every 15 s).
    pub fn connect(addr: SocketAddr, silence: Duration) -> io::Result<Self> {
        let streamed = Request::get("/api/events")
            .header("Accept", "text/event-stream")
            .timeout(silence)
            .open(addr)?;
        let head_ok = streamed.status == 200
            && streamed.header("content-type") == Some("text/event-stream")
            && streamed.header("transfer-encoding") == Some("chunked");
        if !head_ok {
            return Err(io::Error::other(format!(
                "not an event stream: {streamed:?}"
            )));
        }
        Ok(Self {
            body: streamed.body,
            parser: SseParser::new(),
        })
    }

    /// The next event, keep-alive comments skipped; an error when the stream ends, stays
    /// silent too long or sends what is not an event.
    pub fn next_event(&mut self) -> io::Result<SseEvent> {
        loop {
            match self.parser.next_block() {
                Some(Ok(event)) if event.is_comment() => {}
                Some(Ok(event)) => return Ok(event),
                Some(Err(e)) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
                None => {
                    let mut buf = [0u8; 16 * 1024];
                    let n = self.body.read(&mut buf)?;
                    if n == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    self.parser.push(&buf[..n]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_across_reads() {
        let mut p = SseParser::new();
        p.push(b"event: change\nid: 7\ndata: {\"a\":");
        assert!(p.next_block().is_none());
        p.push(b"1}\n\n: keep-alive\n\nevent: lagged\ndata: x\ndata: y\n\n");
        let e = p.next_block().unwrap().unwrap();
        assert_eq!(
            (e.event.as_str(), e.id, e.data.as_str()),
            ("change", Some(7), "{\"a\":1}")
        );
        let c = p.next_block().unwrap().unwrap();
        assert!(c.is_comment());
        assert_eq!(c.data, " keep-alive");
        let l = p.next_block().unwrap().unwrap();
        assert_eq!((l.event.as_str(), l.data.as_str()), ("lagged", "x\ny"));
        assert!(p.next_block().is_none());
    }

    #[test]
    fn unknown_fields_are_errors() {
        assert!(parse_block("retry: 5").is_err());
        assert!(parse_block("id: x").is_err());
    }
}
