//! Helpers of the integration tests: fake programs as real shell scripts, a fake exporter as a
//! real HTTP server, and polling.

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The crate's `testdata/<name>`.
pub fn testdata(name: &str) -> String {
    let path = format!("{}/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    fs_err::read_to_string(path).unwrap()
}

/// Writes an executable `#!/bin/sh` script in `dir`; `$D` is `dir` in its body.
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    let d = dir.display();
    fs_err::write(&path, format!("#!/bin/sh\nD='{d}'\n{body}\n")).unwrap();
    fs_err::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Polls `cond` every 10 ms until it holds; panics after `timeout`.
pub async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `pid` is a live (not zombie) process.
pub fn alive(pid: u32) -> bool {
    match fs_err::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// The lines of a file, or none if it does not exist yet.
pub fn lines(path: &Path) -> Vec<String> {
    fs_err::read_to_string(path)
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// What the fake exporter answers.
#[derive(Debug, Clone)]
pub enum Reply {
    /// `status` with this body.
    Answer(u16, String),
    /// Accept and read the request, never answer.
    Hang,
}

/// A fake dcgm-exporter: a plain HTTP/1.1 server on 127.0.0.1 answering every request the
/// same way, counting them.
pub struct FakeExporter {
    pub port: u16,
    pub requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeExporter {
    pub async fn start(reply: Reply) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let counter = requests.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let reply = reply.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    assert!(buf.starts_with(b"GET /metrics HTTP/1.1\r\n"), "{buf:?}");
                    counter.fetch_add(1, Ordering::SeqCst);
                    match reply {
                        Reply::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
                        Reply::Answer(status, body) => {
                            let head = format!(
                                "HTTP/1.1 {status} X\r\nContent-Type: text/plain; version=0.0.4\r\n\
                                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                                body.len()
                            );
                            let _ = conn.write_all(head.as_bytes()).await;
                            let _ = conn.write_all(body.as_bytes()).await;
                            let _ = conn.shutdown().await;
                        }
                    }
                });
            }
        });
        Self {
            port,
            requests,
            task,
        }
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for FakeExporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A port nothing listens on (bound, then released).
pub async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}
