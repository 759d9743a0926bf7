//! A minimal HTTP/1.1 server side: one request per connection (the answer says
//! `Connection: close`), bodies by `Content-Length` or chunked, answers with a length.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The largest request body accepted (code and file archives the server uploads are small in
/// the tests; upstream accepts any size).
pub const MAX_BODY: usize = 256 * 1024 * 1024;
/// The largest request head (request line and headers).
const MAX_HEAD: usize = 64 * 1024;

/// One request.
#[derive(Debug)]
pub struct Request {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query string (after `?`), empty if none.
    pub query: String,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Request {
    /// The first header called `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The value of query parameter `name` (not percent-decoded: the server sends digits).
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .split('&')
            .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
    }
}

/// An answer.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// 200 with a JSON body, as Go's `json.Encoder` writes it (a trailing newline).
    pub fn json(body: String) -> Self {
        Self {
            status: 200,
            content_type: "application/json",
            body: format!("{body}\n").into_bytes(),
        }
    }

    /// A plain-text answer, as Go's `http.Error` writes it (`message` and a newline): upstream
    /// answers a handler's empty success this way too (`200`, body `"\n"`).
    pub fn text(status: u16, message: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{message}\n").into_bytes(),
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Request Entity Too Large",
        415 => "Unsupported Media Type",
        _ => "Internal Server Error",
    }
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Reads one request from `stream` (bounded waits: a silent peer fails the read).
pub fn read_request(stream: &TcpStream) -> io::Result<Request> {
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut reader = BufReader::new(stream);
    let mut head_len = 0usize;
    let mut line = String::new();
    let mut read_line = |reader: &mut BufReader<&TcpStream>, line: &mut String| {
        line.clear();
        let n = reader.read_line(line)?;
        head_len += n;
        if n == 0 {
            return Err(bad("connection closed in the request head"));
        }
        if head_len > MAX_HEAD {
            return Err(bad("request head too large"));
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_owned())
    };
    let request_line = read_line(&mut reader, &mut line)?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(_version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(bad(format!("bad request line {request_line:?}")));
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut headers = Vec::new();
    loop {
        let header = read_line(&mut reader, &mut line)?;
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            return Err(bad(format!("bad header {header:?}")));
        };
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let mut request = Request {
        method: method.to_owned(),
        path: path.to_owned(),
        query: query.to_owned(),
        headers,
        body: Vec::new(),
    };
    if request
        .header("transfer-encoding")
        .is_some_and(|te| te.eq_ignore_ascii_case("chunked"))
    {
        request.body = read_chunked(&mut reader)?;
    } else if let Some(length) = request.header("content-length") {
        let length: usize = length
            .parse()
            .map_err(|_| bad(format!("bad content-length {length:?}")))?;
        if length > MAX_BODY {
            return Err(bad("request body too large"));
        }
        let mut body = vec![0u8; length];
        reader.read_exact(&mut body)?;
        request.body = body;
    }
    Ok(request)
}

fn read_chunked(reader: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let size = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size, 16).map_err(|_| bad("bad chunk size"))?;
        if body.len() + size > MAX_BODY {
            return Err(bad("request body too large"));
        }
        if size == 0 {
            // Trailers, then the empty line.
            loop {
                line.clear();
                if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
                    return Ok(body);
                }
            }
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..])?;
        line.clear();
        reader.read_line(&mut line)?;
    }
}

/// Writes `response` and closes the write side.
pub fn write_response(mut stream: &TcpStream, response: &Response) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(&response.body)?;
    stream.flush()?;
    stream.shutdown(std::net::Shutdown::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn roundtrip(raw: &'static [u8]) -> io::Result<Request> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let client = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(raw).unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).unwrap();
            answer
        });
        let (stream, _) = listener.accept()?;
        let request = read_request(&stream);
        write_response(&stream, &Response::json("{}".into()))?;
        drop(stream);
        let answer = client.join().unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\n{}\n"), "{answer}");
        request
    }

    #[test]
    fn reads_lengths_chunks_and_queries() {
        let r =
            roundtrip(b"POST /api/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
                .unwrap();
        assert_eq!(
            (r.method.as_str(), r.path.as_str()),
            ("POST", "/api/submit")
        );
        assert_eq!(r.body, b"hello");
        let r = roundtrip(
            b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r.body, b"abcde");
        let r = roundtrip(b"GET /api/pull?timestamp=17&x HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(r.path, "/api/pull");
        assert_eq!(r.query_param("timestamp"), Some("17"));
        assert_eq!(r.query_param("x"), Some(""));
        assert_eq!(r.query_param("y"), None);
        assert!(roundtrip(b"garbage\r\n\r\n").is_err());
    }
}
