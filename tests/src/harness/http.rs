//! A blocking HTTP/1.1 client over TCP or a Unix socket: one request per connection
//! (`Connection: close`), `Content-Length` or chunked request bodies, responses with
//! `Content-Length`, chunked or read-to-close bodies, read whole ([`Request::send`]) or as
//! they arrive ([`Request::open`]: event streams), and bounded connects and reads.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

/// How long a connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a read of the answer may block, unless a request sets its own
/// ([`Request::timeout`]). Generous: a terminate with a grace period answers only once the
/// container stopped.
pub const READ_TIMEOUT: Duration = Duration::from_secs(180);
/// Bodies larger than this are written from a second thread while the answer is read, so a
/// server that answers before reading all of it (413) is seen answering, not as a broken pipe.
const INLINE_BODY_MAX: usize = 64 * 1024;

/// One request. Built with [`Request::new`] (or [`Request::get`], [`Request::post`], …) and
/// sent with [`Request::send`] or [`Request::send_unix`].
#[derive(Debug, Clone)]
pub struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Option<Vec<u8>>,
    chunked: bool,
    timeout: Duration,
}

impl Request {
    /// `method path`, no body.
    pub fn new(method: &str, path: &str) -> Self {
        Self {
            method: method.to_owned(),
            path: path.to_owned(),
            headers: Vec::new(),
            body: None,
            chunked: false,
            timeout: READ_TIMEOUT,
        }
    }

    /// `GET path`.
    pub fn get(path: &str) -> Self {
        Self::new("GET", path)
    }

    /// `POST path` (with `Content-Length: 0` unless a body is set).
    pub fn post(path: &str) -> Self {
        Self::new("POST", path)
    }

    /// Adds a header.
    #[must_use]
    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// Sets a body sent with `Content-Length`, and `Content-Type: content_type` if given.
    #[must_use]
    pub fn body(mut self, content_type: Option<&str>, body: impl Into<Vec<u8>>) -> Self {
        if let Some(ct) = content_type {
            self = self.header("Content-Type", ct);
        }
        self.body = Some(body.into());
        self.chunked = false;
        self
    }

    /// Like [`Request::body`] but sent with `Transfer-Encoding: chunked` (64 KiB chunks).
    #[must_use]
    pub fn chunked_body(mut self, content_type: Option<&str>, body: impl Into<Vec<u8>>) -> Self {
        self = self.body(content_type, body);
        self.chunked = true;
        self
    }

    /// Sets `value` as an `application/json` body.
    #[must_use]
    pub fn json(self, value: &Value) -> Self {
        self.body(Some("application/json"), value.to_string())
    }

    /// Sets how long reading the answer may block.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends the request over a new TCP connection to `addr` and reads the whole answer.
    pub fn send(&self, addr: SocketAddr) -> io::Result<Response> {
        let result = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).and_then(|stream| {
            stream.set_nodelay(true)?;
            self.exchange(stream, &addr.to_string())
        });
        result.map_err(|e| self.context(&addr.to_string(), e))
    }

    /// Sends the request over a new connection to the Unix socket at `path`.
    pub fn send_unix(&self, path: &Path) -> io::Result<Response> {
        let result =
            UnixStream::connect(path).and_then(|stream| self.exchange(stream, "localhost"));
        result.map_err(|e| self.context(&path.display().to_string(), e))
    }

    /// Sends the request over a new TCP connection to `addr` and reads the answer's head;
    /// its body is read as it arrives (an event stream). Reads block at most the request's
    /// [`Request::timeout`] each.
    pub fn open(&self, addr: SocketAddr) -> io::Result<Streamed<TcpStream>> {
        let result = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).and_then(|stream| {
            stream.set_nodelay(true)?;
            self.start(stream, &addr.to_string())
        });
        result.map_err(|e| self.context(&addr.to_string(), e))
    }

    /// [`Request::open`] over a new connection to the Unix socket at `path`.
    pub fn open_unix(&self, path: &Path) -> io::Result<Streamed<UnixStream>> {
        let result = UnixStream::connect(path).and_then(|stream| self.start(stream, "localhost"));
        result.map_err(|e| self.context(&path.display().to_string(), e))
    }

    /// Writes the request and reads the answer's head.
    fn start<S>(&self, stream: S, host: &str) -> io::Result<Streamed<S>>
    where
        S: Stream + Read + Write,
    {
        stream.set_timeouts(self.timeout)?;
        let (head, payload) = self.encode(host);
        let mut stream = stream;
        stream.write_all(&head)?;
        stream.write_all(&payload)?;
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader)?;
        let body = Body::new(reader, status, &headers, self.method == "HEAD")?;
        Ok(Streamed {
            status,
            headers,
            body,
        })
    }

    fn context(&self, target: &str, e: io::Error) -> io::Error {
        io::Error::new(
            e.kind(),
            format!("{} {} on {target}: {e}", self.method, self.path),
        )
    }

    /// The request head and the encoded body.
    fn encode(&self, host: &str) -> (Vec<u8>, Vec<u8>) {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: shim-e2e\r\nConnection: close\r\n",
            self.method, self.path
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        let mut payload = Vec::new();
        match &self.body {
            None if matches!(self.method.as_str(), "POST" | "PUT" | "PATCH") => {
                head.push_str("Content-Length: 0\r\n");
            }
            None => {}
            Some(body) if self.chunked => {
                head.push_str("Transfer-Encoding: chunked\r\n");
                for chunk in body.chunks(64 * 1024) {
                    payload.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                    payload.extend_from_slice(chunk);
                    payload.extend_from_slice(b"\r\n");
                }
                payload.extend_from_slice(b"0\r\n\r\n");
            }
            Some(body) => {
                head.push_str(&format!("Content-Length: {}\r\n", body.len()));
                payload.extend_from_slice(body);
            }
        }
        head.push_str("\r\n");
        (head.into_bytes(), payload)
    }

    fn exchange<S>(&self, stream: S, host: &str) -> io::Result<Response>
    where
        S: Stream,
        for<'a> &'a S: Read + Write,
    {
        stream.set_timeouts(self.timeout)?;
        let (head, payload) = self.encode(host);
        let response = if head.len() + payload.len() <= INLINE_BODY_MAX {
            (&stream).write_all(&head)?;
            (&stream).write_all(&payload)?;
            read_response(BufReader::new(&stream), self.method == "HEAD")
        } else {
            let writer = stream.duplicate()?;
            std::thread::scope(|s| {
                s.spawn(move || {
                    // Errors are the server closing early; the answer tells what happened.
                    let mut writer = &writer;
                    let _ = writer.write_all(&head);
                    let _ = writer.write_all(&payload);
                    let _ = writer.flush();
                });
                let response = read_response(BufReader::new(&stream), self.method == "HEAD");
                // Unblocks the writer if the server stopped reading.
                stream.close();
                response
            })
        };
        stream.close();
        response
    }
}

/// The two kinds of connection a [`Request`] is sent over.
trait Stream: Sized + Send + Sync {
    fn set_timeouts(&self, timeout: Duration) -> io::Result<()>;
    fn duplicate(&self) -> io::Result<Self>;
    fn close(&self);
}

macro_rules! impl_stream {
    ($($t:ty),*) => {$(
        impl Stream for $t {
            fn set_timeouts(&self, timeout: Duration) -> io::Result<()> {
                self.set_read_timeout(Some(timeout))?;
                self.set_write_timeout(Some(timeout))
            }
            fn duplicate(&self) -> io::Result<Self> {
                self.try_clone()
            }
            fn close(&self) {
                let _ = self.shutdown(Shutdown::Both);
            }
        }
    )*};
}

impl_stream!(TcpStream, UnixStream);

/// An answer: status code, headers (names lowercased, in order) and the body (chunked
/// transfer decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body as text.
    pub body: String,
}

impl Response {
    /// The first header called `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> io::Result<Value> {
        serde_json::from_str(&self.body).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the answer ({}) is not JSON ({e}): {:?}",
                    self.status, self.body
                ),
            )
        })
    }
}

/// Checks for tests: each panics (failing the test) with the whole answer when it does not
/// hold.
#[allow(
    clippy::panic,
    reason = "test assertions: a failed check fails the test"
)]
impl Response {
    /// Asserts `Content-Type: application/json` and returns the parsed body.
    pub fn json_body(&self) -> Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "not a JSON answer: {self:?}"
        );
        self.json().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Asserts a 200 with a JSON body ([`Response::json_body`]) and returns that body.
    pub fn ok(&self) -> Value {
        assert_eq!(self.status, 200, "expected 200, got {self:?}");
        self.json_body()
    }

    /// Asserts the error `status` with a `text/plain` body of `message` and a newline (the
    /// shim answers errors as upstream's Go shim does, with `http.Error`).
    pub fn assert_error(&self, status: u16, message: &str) {
        assert_eq!(
            (self.status, self.body.as_str()),
            (status, format!("{message}\n").as_str()),
            "{self:?}"
        );
        self.assert_text_plain();
    }

    /// Asserts the answer of a request that returns nothing (shutdown, remove, install): 200
    /// and a lone newline as `text/plain`, as upstream's Go shim answers it
    /// (`runner/internal/common/api/api.go`, `JSONResponseHandler`: a nil body goes to
    /// `http.Error(w, "", 200)`).
    pub fn assert_empty_ok(&self) {
        self.assert_error(200, "");
    }

    /// Asserts the error `status` with a `text/plain` body starting with `prefix`.
    pub fn assert_error_starts(&self, status: u16, prefix: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert!(
            self.body.starts_with(prefix),
            "{prefix:?} expected: {self:?}"
        );
        self.assert_text_plain();
    }

    /// Asserts a `text/plain` answer (what every error of the shim is).
    pub fn assert_text_plain(&self) {
        assert!(
            self.header("content-type")
                .is_some_and(|ct| ct.starts_with("text/plain")),
            "errors are text/plain: {self:?}"
        );
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// Reads an answer's status line and headers (names lowercased, in order) from `reader`.
fn read_head(reader: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| invalid(format!("not an HTTP status line: {:?}", line.trim_end())))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Err(invalid(
                "the connection closed inside the headers".to_owned(),
            ));
        }
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        let (name, value) = trimmed
            .split_once(':')
            .ok_or_else(|| invalid(format!("bad header line {trimmed:?}")))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    Ok((status, headers))
}

/// Reads one answer from `reader`; `head_only` for the answer to a HEAD request.
pub fn read_response(mut reader: impl BufRead, head_only: bool) -> io::Result<Response> {
    let (status, headers) = read_head(&mut reader)?;
    let mut body = Vec::new();
    Body::new(&mut reader, status, &headers, head_only)?.read_to_end(&mut body)?;
    let body = String::from_utf8(body)
        .map_err(|e| invalid(format!("the body ({status}) is not UTF-8: {e}")))?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// The body of an answer as it arrives: chunked transfer decoded, a `Content-Length` body
/// ended after its length, any other read until the connection closes. A body cut short is
/// an error (`UnexpectedEof`), a malformed chunk `InvalidData`.
#[derive(Debug)]
pub struct Body<R> {
    reader: R,
    framing: Framing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Chunked: what is left of the current chunk (0: a size line comes next).
    Chunked(usize),
    /// `Content-Length`: what is left of it.
    Length(usize),
    /// Until the connection closes.
    Close,
    /// Read to its end.
    Done,
}

impl<R: BufRead> Body<R> {
    /// The body that follows a head with `status` and `headers` in `reader`; `head_only` for
    /// the answer to a HEAD request (no body).
    fn new(
        reader: R,
        status: u16,
        headers: &[(String, String)],
        head_only: bool,
    ) -> io::Result<Self> {
        let find = |n: &str| headers.iter().find(|(name, _)| name == n).map(|(_, v)| v);
        let no_body = head_only || status == 204 || status == 304 || (100..200).contains(&status);
        let framing = if no_body {
            Framing::Done
        } else if find("transfer-encoding")
            .is_some_and(|te| te.to_ascii_lowercase().contains("chunked"))
        {
            Framing::Chunked(0)
        } else if let Some(len) = find("content-length") {
            let len: usize = len
                .parse()
                .map_err(|_| invalid(format!("bad Content-Length {len:?}")))?;
            Framing::Length(len)
        } else {
            Framing::Close
        };
        Ok(Self { reader, framing })
    }

    /// The connection it reads from (e.g. to shut it down from another thread).
    pub fn get_ref(&self) -> &R {
        &self.reader
    }

    /// Reads a chunk's size line; 0 is the last chunk, whose trailers and final empty line
    /// are read too (a server may also just close).
    fn chunk_size(&mut self) -> io::Result<usize> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "truncated chunked body",
            ));
        }
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| invalid(format!("bad chunk size {size_text:?}")))?;
        if size == 0 {
            loop {
                line.clear();
                if self.reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                    break;
                }
            }
        }
        Ok(size)
    }
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let left = match self.framing {
            Framing::Done => return Ok(0),
            Framing::Close => return self.reader.read(buf),
            Framing::Length(0) => {
                self.framing = Framing::Done;
                return Ok(0);
            }
            Framing::Length(left) => left,
            Framing::Chunked(0) => match self.chunk_size()? {
                0 => {
                    self.framing = Framing::Done;
                    return Ok(0);
                }
                size => size,
            },
            Framing::Chunked(left) => left,
        };
        let want = buf.len().min(left);
        let n = self.reader.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the body ended {left} bytes short"),
            ));
        }
        self.framing = match self.framing {
            Framing::Length(_) => Framing::Length(left - n),
            _ if left > n => Framing::Chunked(left - n),
            _ => {
                let mut crlf = String::new();
                self.reader.read_line(&mut crlf)?;
                if crlf != "\r\n" {
                    return Err(invalid(format!("no CRLF after a chunk: {crlf:?}")));
                }
                Framing::Chunked(0)
            }
        };
        Ok(n)
    }
}

/// An answer whose body is read as it arrives ([`Request::open`]): an event stream.
#[derive(Debug)]
pub struct Streamed<S> {
    /// The status code.
    pub status: u16,
    /// The headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body: reads block until more of it arrives (up to the request's timeout).
    pub body: Body<BufReader<S>>,
}

impl<S> Streamed<S> {
    /// The first header called `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The JSON API of a shim listening on `addr`, with the checks every caller wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Api {
    /// Where the shim listens.
    pub addr: SocketAddr,
}

impl Api {
    /// `method path` with an optional JSON `body`; the answer whatever its status.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> io::Result<Response> {
        let mut request = Request::new(method, path);
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send(self.addr)
    }

    /// `method path` with `body`; fails unless the answer's status is `expect`.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        expect: u16,
    ) -> io::Result<Response> {
        let response = self.request(method, path, body)?;
        if response.status != expect {
            return Err(io::Error::other(format!(
                "{method} {path}: expected {expect}, got {}: {}",
                response.status,
                response.body.trim()
            )));
        }
        Ok(response)
    }

    /// `GET path`, which must answer 200 with JSON.
    pub fn get(&self, path: &str) -> io::Result<Value> {
        self.call("GET", path, None, 200)?.json()
    }

    /// `POST path` with a JSON `body`, which must answer 200; the answer's JSON (`null` if the
    /// body is empty).
    pub fn post(&self, path: &str, body: &Value) -> io::Result<Value> {
        let response = self.call("POST", path, Some(body), 200)?;
        if response.body.trim().is_empty() {
            return Ok(Value::Null);
        }
        response.json()
    }

    /// The TaskInfo of task `id`.
    pub fn task(&self, id: &str) -> io::Result<Value> {
        self.get(&format!("/api/tasks/{id}"))
    }

    /// Whether `GET /api/healthcheck` answers 200.
    pub fn answers(&self) -> bool {
        Request::get("/api/healthcheck")
            .timeout(Duration::from_secs(10))
            .send(self.addr)
            .is_ok_and(|r| r.status == 200)
    }

    /// `GET /api/tasks` as a map id → status (every id once).
    pub fn list(&self) -> io::Result<BTreeMap<String, String>> {
        let list = self.get("/api/tasks")?;
        let bad = |what: String| io::Error::other(format!("GET /api/tasks: {what} in {list}"));
        let tasks = list["tasks"]
            .as_array()
            .ok_or_else(|| bad("tasks is not an array".into()))?;
        let mut map = BTreeMap::new();
        for t in tasks {
            let field = |f: &str| {
                t[f].as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| bad(format!("no {f}")))
            };
            if map.insert(field("id")?, field("status")?).is_some() {
                return Err(bad(format!("a duplicate id {}", t["id"])));
            }
        }
        Ok(map)
    }

    /// Polls task `id` every `every` until its status is `status`; its TaskInfo and when that
    /// was first seen. Fails when the task ends (`terminated`) while another status is
    /// awaited, when an answer is not a TaskInfo, and once `bound` has passed.
    pub fn wait_status(
        &self,
        id: &str,
        status: &str,
        every: Duration,
        bound: Duration,
    ) -> io::Result<(Value, SystemTime)> {
        let started = Instant::now();
        loop {
            let info = self.task(id)?;
            let now = status_of(&info);
            if now == status {
                return Ok((info, SystemTime::now()));
            }
            if now == "terminated" {
                return Err(io::Error::other(format!(
                    "task {id} ended while waiting for {status}: {info}"
                )));
            }
            if started.elapsed() > bound {
                return Err(io::Error::other(format!(
                    "task {id} not {status} within {bound:?}: {info}"
                )));
            }
            std::thread::sleep(every);
        }
    }

    /// Terminates `id` (`POST /api/tasks/<id>/terminate`), which must answer 200 with the
    /// TaskInfo of a `terminated` task; that TaskInfo.
    pub fn terminate(
        &self,
        id: &str,
        reason: &str,
        message: &str,
        timeout: u64,
    ) -> io::Result<Value> {
        let info = self.post(
            &format!("/api/tasks/{id}/terminate"),
            &serde_json::json!({
                "termination_reason": reason,
                "termination_message": message,
                "timeout": timeout,
            }),
        )?;
        if status_of(&info) != "terminated" {
            return Err(io::Error::other(format!(
                "terminate {id}: the answer is not a terminated task: {info}"
            )));
        }
        Ok(info)
    }

    /// Removes a terminated task, retrying (every 2 ms at first, backing off to 50 ms) while
    /// the shim answers 409 because the task's start job has not given it up yet or a release
    /// is in flight: the dstack server retries too. Fails on any other answer than 200 with
    /// upstream's empty answer (a lone newline), and once `bound` has passed.
    pub fn remove_retrying(&self, id: &str, bound: Duration) -> io::Result<()> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(2);
        loop {
            let removed = self.request("POST", &format!("/api/tasks/{id}/remove"), None)?;
            let message = removed.body.trim_end();
            let busy = removed.status == 409
                && (message.ends_with("is still being started")
                    || message.ends_with("is releasing its resources"));
            if busy && started.elapsed() < bound {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
                continue;
            }
            if (removed.status, removed.body.as_str()) != (200, "\n") {
                return Err(io::Error::other(format!("remove {id}: {removed:?}")));
            }
            return Ok(());
        }
    }

    /// Terminates (at once: timeout 0) and removes a task, retrying the remove within
    /// `bound` ([`Api::remove_retrying`]); then the shim must not know it (404 `Not Found`,
    /// upstream's answer for an unknown task).
    pub fn finish(&self, id: &str, reason: &str, message: &str, bound: Duration) -> io::Result<()> {
        self.terminate(id, reason, message, 0)?;
        self.remove_retrying(id, bound)?;
        let gone = self.request("GET", &format!("/api/tasks/{id}"), None)?;
        if (gone.status, gone.body.as_str()) != (404, "Not Found\n") {
            return Err(io::Error::other(format!(
                "task {id} is still known after its remove: {gone:?}"
            )));
        }
        Ok(())
    }
}

/// The `status` field of a TaskInfo (`?` if there is none).
pub fn status_of(info: &Value) -> &str {
    info["status"].as_str().unwrap_or("?")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "test code")]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn parse(raw: &[u8]) -> io::Result<Response> {
        read_response(raw, false)
    }

    #[test]
    fn parses_plain_chunked_and_close_delimited_answers() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\n{}").unwrap();
        assert_eq!(
            (r.status, r.body.as_str(), r.header("x-a")),
            (200, "{}", Some("b"))
        );
        let r = parse(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_str()), (404, "abcde"));
        let r = parse(b"HTTP/1.0 200 OK\r\n\r\nuntil close").unwrap();
        assert_eq!(r.body, "until close");
        let r = read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"[..], true).unwrap();
        assert_eq!(r.body, "");
        assert!(parse(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Len").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err());
    }

    /// Serves one connection: reads the request until `until` is in it, answers `answer`.
    fn serve_once(
        until: &'static str,
        answer: &'static str,
    ) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 64 * 1024];
            while !String::from_utf8_lossy(&request).contains(until) {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0, "client closed early");
                request.extend_from_slice(&buf[..n]);
            }
            stream.write_all(answer.as_bytes()).unwrap();
            String::from_utf8(request).unwrap()
        });
        (addr, server)
    }

    #[test]
    fn api_sends_json_and_reports_an_unexpected_status() {
        let (addr, server) = serve_once(
            "{\"a\":1}",
            "HTTP/1.1 409 Conflict\r\nContent-Length: 4\r\n\r\nbusy",
        );
        let err = Api { addr }
            .post("/api/tasks", &serde_json::json!({"a": 1}))
            .unwrap_err();
        assert!(err.to_string().contains("got 409: busy"), "{err}");
        let request = server.join().unwrap();
        assert!(
            request.starts_with("POST /api/tasks HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(
            request.contains("Content-Type: application/json\r\n"),
            "{request}"
        );
        assert!(request.contains("Content-Length: 7\r\n"), "{request}");
    }

    #[test]
    fn sends_headers_and_chunked_bodies() {
        let (addr, server) = serve_once(
            "0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        );
        let big = vec![b'x'; 100 * 1024];
        let r = Request::post("/p")
            .header("Authorization", "Basic dTpw")
            .chunked_body(Some("text/plain"), big)
            .send(addr)
            .unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));
        let request = server.join().unwrap();
        assert!(
            request.contains("Authorization: Basic dTpw\r\n"),
            "{request}"
        );
        assert!(
            request.contains("Transfer-Encoding: chunked\r\n\r\n10000\r\n"),
            "{request}"
        );
        assert!(!request.contains("Content-Length"), "{request}");
    }

    #[test]
    fn a_streamed_body_is_read_as_it_arrives() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let mut request = Vec::new();
            while !request.ends_with(b"\r\n\r\n") {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0);
                request.extend_from_slice(&buf[..n]);
            }
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n6\r\nfirst\n\r\n")
                .unwrap();
            // The second chunk only once the client has read the first.
            wait.recv().unwrap();
            stream.write_all(b"7\r\nsecond\n\r\n0\r\n\r\n").unwrap();
        });
        // A client that waited for the whole body would time out instead.
        let mut streamed = Request::get("/events")
            .timeout(Duration::from_secs(10))
            .open(addr)
            .unwrap();
        assert_eq!((streamed.status, streamed.header("x-a")), (200, Some("b")));
        let mut lines = BufReader::new(&mut streamed.body).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "first");
        go_on.send(()).unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), "second");
        assert!(lines.next().is_none(), "the last chunk ends the body");
        server.join().unwrap();
    }

    #[test]
    fn a_body_cut_short_is_an_error() {
        let mut body = Vec::new();
        let mut reader = &b"5\r\nab"[..];
        let err = Body::new(
            &mut reader,
            200,
            &[("transfer-encoding".to_owned(), "chunked".to_owned())],
            false,
        )
        .unwrap()
        .read_to_end(&mut body)
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
        let err = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX\r\n")
            .unwrap_err();
        assert!(err.to_string().contains("no CRLF after a chunk"), "{err}");
    }

    #[test]
    fn silence_and_closed_ports_are_errors() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepts (backlog) but never answers: the read times out.
        let err = Request::get("/x")
            .timeout(Duration::from_millis(100))
            .send(addr)
            .unwrap_err();
        assert!(err.to_string().contains("GET /x on 127.0.0.1"), "{err}");
        drop(listener);
        assert!(Request::get("/x").send(addr).is_err());
        assert!(!Api { addr }.answers());
    }
}
