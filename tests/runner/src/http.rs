//! The HTTP side, on `tiny_http` (HTTP/1.1, keep-alive, bodies by `Content-Length` or chunked):
//! each request is read whole into a [`Request`] and answered on its own thread, so that the
//! runner's handlers are plain functions of a request.

use std::io::Read as _;
use std::sync::Arc;

/// The largest request body accepted (code and file archives the server uploads are small in
/// the tests; upstream accepts any size).
pub const MAX_BODY: usize = 256 * 1024 * 1024;

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
            .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
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
    /// 200 with `value` as JSON, as Go's `json.Encoder` writes it (a trailing newline).
    pub fn json(value: &impl serde::Serialize) -> Self {
        match serde_json::to_vec(value) {
            Ok(mut body) => {
                body.push(b'\n');
                Self {
                    status: 200,
                    content_type: "application/json",
                    body,
                }
            }
            Err(e) => Self::text(500, &format!("encode the answer: {e}")),
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

/// Reads the whole of `request`, or the answer to give instead (413 over [`MAX_BODY`], 400 for
/// a body that cannot be read).
fn read(request: &mut tiny_http::Request) -> Result<Request, Response> {
    let too_large = || Response::text(413, "Request Entity Too Large");
    if request
        .body_length()
        .is_some_and(|length| length > MAX_BODY)
    {
        return Err(too_large());
    }
    let url = request.url();
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let (path, query) = (path.to_owned(), query.to_owned());
    let headers = request
        .headers()
        .iter()
        .map(|h| {
            let name = h.field.as_str().as_str().to_ascii_lowercase();
            (name, h.value.as_str().to_owned())
        })
        .collect();
    let mut body = Vec::new();
    let limit = u64::try_from(MAX_BODY)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    if let Err(e) = request.as_reader().take(limit).read_to_end(&mut body) {
        return Err(Response::text(400, &format!("read the request body: {e}")));
    }
    if body.len() > MAX_BODY {
        return Err(too_large());
    }
    Ok(Request {
        method: request.method().as_str().to_owned(),
        path,
        query,
        headers,
        body,
    })
}

/// Answers `request` with `response`, always with a `Content-Length` (never chunked).
fn respond(request: tiny_http::Request, response: Response) -> std::io::Result<()> {
    let mut answer = tiny_http::Response::from_data(response.body)
        .with_status_code(response.status)
        .with_chunked_threshold(usize::MAX);
    if let Ok(header) = tiny_http::Header::from_bytes("Content-Type", response.content_type) {
        answer.add_header(header);
    }
    request.respond(answer)
}

/// Serves `server`'s requests with `handle` until the server fails, each request on a thread
/// of its own (a handler may take a lock the job's thread holds).
pub fn serve<H>(server: &tiny_http::Server, handle: Arc<H>)
where
    H: Fn(&Request) -> Response + Send + Sync + 'static,
{
    for mut incoming in server.incoming_requests() {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || {
            let response = match read(&mut incoming) {
                Ok(request) => handle(&request),
                Err(response) => response,
            };
            let _ = respond(incoming, response);
        });
    }
}
