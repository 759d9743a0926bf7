//! [`LosingProxy`]: a proxy on a Unix socket in front of Docker's that loses answers.
//!
//! It passes requests and answers through (HTTP/1.1 with keep-alive; bodies framed by
//! `Content-Length` or chunked, forwarded as they come, so a streamed answer such as `/events`
//! flows), except the answer to the first request whose request line contains each of its
//! patterns: that request reaches Docker, which carries it out and answers, and the client's
//! connection is closed instead of the answer. This is what a request timeout on a loaded daemon
//! looks like from the client: the work was done, the answer never came. Or, made with
//! [`LosingProxy::holding`], the connection is kept open and silent instead: an answer that
//! never comes, until the client gives up.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The Docker daemon's socket: `DOCKER_HOST` when it is a `unix://` path, else the default.
pub fn docker_socket() -> PathBuf {
    match std::env::var("DOCKER_HOST") {
        Ok(host) if host.starts_with("unix://") => PathBuf::from(&host["unix://".len()..]),
        _ => PathBuf::from("/var/run/docker.sock"),
    }
}

/// See the module docs. Stops accepting when dropped.
pub struct LosingProxy {
    path: PathBuf,
    lost: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    _dir: tempfile::TempDir,
}

impl LosingProxy {
    /// Listens on a new socket in a temporary directory, in front of `upstream`, losing the
    /// answer to the first request matching each of `lose` (a substring of the request line,
    /// such as `"/start "` or `"/containers/create"`).
    pub fn start(upstream: &Path, lose: &[&str]) -> io::Result<Self> {
        Self::with(upstream, lose, false)
    }

    /// [`LosingProxy::start`], but each answer it loses is held instead: the client's
    /// connection stays open and silent until the client gives up and closes it (an answer
    /// that never comes, where [`LosingProxy::start`]'s is cut off).
    pub fn holding(upstream: &Path, hold: &[&str]) -> io::Result<Self> {
        Self::with(upstream, hold, true)
    }

    fn with(upstream: &Path, lose: &[&str], hold: bool) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("losing-proxy-").tempdir()?;
        let path = dir.path().join("docker.sock");
        let listener = UnixListener::bind(&path)?;
        let lost = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let patterns: Arc<Vec<(String, AtomicUsize)>> = Arc::new(
            lose.iter()
                .map(|p| ((*p).to_owned(), AtomicUsize::new(0)))
                .collect(),
        );
        let (upstream, accepted_lost, accepting) =
            (upstream.to_owned(), lost.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if accepting.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let (upstream, patterns, lost) =
                    (upstream.clone(), patterns.clone(), accepted_lost.clone());
                std::thread::spawn(move || {
                    // An error ends this connection only (the client sees it closed).
                    let _ = serve(client, &upstream, &patterns, &lost, hold);
                });
            }
        });
        Ok(Self {
            path,
            lost,
            stop,
            _dir: dir,
        })
    }

    /// The proxy as a `DOCKER_HOST` value.
    pub fn host(&self) -> String {
        format!("unix://{}", self.path.display())
    }

    /// The request lines whose answers were lost so far.
    pub fn lost(&self) -> Vec<String> {
        self.lost
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for LosingProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the stop.
        let _ = UnixStream::connect(&self.path);
    }
}

/// Serves one client connection, request by request.
fn serve(
    client: UnixStream,
    upstream: &Path,
    patterns: &[(String, AtomicUsize)],
    lost: &Mutex<Vec<String>>,
    hold: bool,
) -> io::Result<()> {
    let server = UnixStream::connect(upstream)?;
    let mut from_client = BufReader::new(client.try_clone()?);
    let mut to_client = client;
    let mut from_server = BufReader::new(server.try_clone()?);
    let mut to_server = server;
    while let Some(request) = read_head(&mut from_client)? {
        to_server.write_all(&request)?;
        copy_body(&mut from_client, &mut to_server, &request, true)?;
        let Some(answer) = read_head(&mut from_server)? else {
            return Ok(());
        };
        let line = String::from_utf8_lossy(&request)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned();
        let lose = patterns
            .iter()
            .any(|(p, n)| line.contains(p.as_str()) && n.fetch_add(1, Ordering::SeqCst) == 0);
        if lose {
            lost.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(line);
            if hold {
                // Silent until the client closes its end.
                io::copy(&mut from_client, &mut io::sink())?;
            }
            return Ok(()); // both connections close: the answer is lost
        }
        to_client.write_all(&answer)?;
        let bodyless = line.starts_with("HEAD ") || status_without_body(&answer);
        if !bodyless {
            copy_body(&mut from_server, &mut to_client, &answer, false)?;
        }
    }
    Ok(())
}

/// A message head through its blank line; `None` at the end of the stream.
fn read_head(r: &mut impl BufRead) -> io::Result<Option<Vec<u8>>> {
    let mut head = Vec::new();
    loop {
        if r.read_until(b'\n', &mut head)? == 0 {
            return Ok(None);
        }
        if head.ends_with(b"\r\n\r\n") {
            return Ok(Some(head));
        }
    }
}

/// Whether an answer's status has no body (1xx, 204, 304).
fn status_without_body(head: &[u8]) -> bool {
    let head = String::from_utf8_lossy(head);
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    status.starts_with('1') || status == "204" || status == "304"
}

/// Forwards the body `head` announces, as it comes: `Content-Length` bytes, or chunks through
/// the last one; without either, a request has none and an answer runs to the end of the
/// stream.
fn copy_body(
    r: &mut impl BufRead,
    w: &mut impl Write,
    head: &[u8],
    is_request: bool,
) -> io::Result<()> {
    let head = String::from_utf8_lossy(head).to_ascii_lowercase();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    if let Some(len) = header("content-length:") {
        let len: u64 = len
            .parse()
            .map_err(|_| io::Error::other(format!("bad content-length {len:?}")))?;
        io::copy(&mut r.take(len), w)?;
    } else if header("transfer-encoding:").is_some_and(|v| v.contains("chunked")) {
        loop {
            let mut size_line = Vec::new();
            r.read_until(b'\n', &mut size_line)?;
            let text = String::from_utf8_lossy(&size_line);
            let hex = text.trim().split(';').next().unwrap_or_default().to_owned();
            let size = u64::from_str_radix(&hex, 16)
                .map_err(|_| io::Error::other(format!("bad chunk size {hex:?}")))?;
            w.write_all(&size_line)?;
            // The chunk and its CRLF (after the last chunk: the final CRLF).
            io::copy(&mut r.take(size + 2), w)?;
            w.flush()?;
            if size == 0 {
                return Ok(());
            }
        }
    } else if !is_request {
        io::copy(r, w)?;
    }
    Ok(())
}
