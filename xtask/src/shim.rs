//! A running `dstack-shim` for `demo` and `bench`: building and starting the binary on a
//! temporary home, a small JSON client for its HTTP API, and cleanup of the containers it made.

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::cmd;
use crate::run::cargo;

/// Cargo's target directory (`CARGO_TARGET_DIR`, else `<repo>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => shim_e2e::repo_root().join("target"),
    }
}

/// Builds `dstack-shim` (`release` or debug) and returns the path of the binary.
pub fn build(release: bool) -> Result<PathBuf> {
    let mut command = cmd::cmd(cargo());
    command.current_dir(shim_e2e::repo_root()).args([
        "build",
        "-p",
        "dstack-shim",
        "--bin",
        "dstack-shim",
    ]);
    if release {
        command.arg("--release");
    }
    cmd::run(&mut command).context("could not build dstack-shim")?;
    let binary = target_dir()
        .join(if release { "release" } else { "debug" })
        .join("dstack-shim");
    anyhow::ensure!(binary.is_file(), "{} was not built", binary.display());
    Ok(binary)
}

/// A free TCP port on 127.0.0.1 (bound, then released: another process could take it first,
/// which the shim then reports as an address in use).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("no free port")?;
    Ok(listener.local_addr()?.port())
}

/// An answer of the shim's API.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The body (chunked transfer decoded).
    pub body: Vec<u8>,
}

impl Response {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON.
    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("the answer is not JSON: {:?}", self.text()))
    }
}

/// Sends one HTTP/1.1 request (a new connection, `Connection: close`) with an optional JSON
/// body and reads the whole answer.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("nothing answers on {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    stream.set_nodelay(true)?;
    let payload = body.map(Value::to_string).unwrap_or_default();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: dstack-shim-xtask\r\n\
         Connection: close\r\nContent-Length: {}\r\n",
        payload.len()
    );
    if body.is_some() {
        head.push_str("Content-Type: application/json\r\n");
    }
    head.push_str("\r\n");
    head.push_str(&payload);
    stream
        .write_all(head.as_bytes())
        .with_context(|| format!("could not send {method} {path} to {addr}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .with_context(|| format!("no complete answer to {method} {path} from {addr}"))?;
    parse_response(&raw).with_context(|| format!("bad answer to {method} {path} from {addr}"))
}

fn parse_response(raw: &[u8]) -> Result<Response> {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        bail!("no end of headers in {:?}", String::from_utf8_lossy(raw));
    };
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let Some(status) = status_line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok())
    else {
        bail!("not HTTP: {status_line:?}");
    };
    let chunked = lines.any(|line| {
        let lower = line.to_ascii_lowercase();
        lower.starts_with("transfer-encoding:") && lower.contains("chunked")
    });
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            bail!("truncated chunk size");
        };
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .with_context(|| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(body);
        }
        anyhow::ensure!(rest.len() >= size + 2, "truncated chunk");
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// The API of a shim on `addr`.
#[derive(Debug, Clone, Copy)]
pub struct Api {
    /// Where the shim listens.
    pub addr: SocketAddr,
}

impl Api {
    /// `method path` with `body`; fails unless the answer is `expect`.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        expect: u16,
    ) -> Result<Response> {
        let response = request(self.addr, method, path, body)?;
        if response.status != expect {
            bail!(
                "{method} {path}: expected {expect}, got {}: {}",
                response.status,
                response.text().trim()
            );
        }
        Ok(response)
    }

    /// `GET path`, which must answer 200 with JSON.
    pub fn get(&self, path: &str) -> Result<Value> {
        self.call("GET", path, None, 200)?.json()
    }

    /// `POST path` with a JSON `body`, which must answer 200; the answer's JSON (`null` if
    /// the body is empty).
    pub fn post(&self, path: &str, body: &Value) -> Result<Value> {
        let response = self.call("POST", path, Some(body), 200)?;
        if response.body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        response.json()
    }

    /// The task's TaskInfo.
    pub fn task(&self, id: &str) -> Result<Value> {
        self.get(&format!("/api/tasks/{id}"))
    }

    /// Whether the healthcheck answers.
    pub fn answers(&self) -> bool {
        request(self.addr, "GET", "/api/healthcheck", None).is_ok_and(|r| r.status == 200)
    }
}

/// The `status` field of a TaskInfo.
pub fn status_of(info: &Value) -> &str {
    info["status"].as_str().unwrap_or("?")
}

/// A `dstack-shim` process started by xtask. Killed (SIGKILL) when dropped unless it exited.
pub struct ShimProcess {
    child: Child,
    /// Its API.
    pub api: Api,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
}

impl ShimProcess {
    /// Starts `binary --shim-home home --shim-http-port port args..`, output appended to
    /// `log`, and waits (at most 60 s, polling every 5 ms) until its healthcheck answers.
    pub fn start(
        binary: &Path,
        home: &Path,
        port: u16,
        args: &[String],
        log: &Path,
    ) -> Result<ShimProcess> {
        let mut shim = Self::spawn(binary, home, port, args, log)?;
        shim.wait_until_answering(Duration::from_secs(60), Duration::from_millis(5))?;
        Ok(shim)
    }

    /// Starts the shim without waiting for it.
    pub fn spawn(
        binary: &Path,
        home: &Path,
        port: u16,
        args: &[String],
        log: &Path,
    ) -> Result<ShimProcess> {
        let file = || -> Result<std::fs::File> {
            Ok(fs_err::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)?
                .into_parts()
                .0)
        };
        let mut command = cmd::cmd(binary);
        command
            .arg("--shim-home")
            .arg(home)
            .arg("--shim-http-port")
            .arg(port.to_string())
            .args(args)
            .stdin(Stdio::null())
            .stdout(file()?)
            .stderr(file()?);
        let line = cmd::display(&command);
        let child = command
            .spawn()
            .with_context(|| format!("could not start `{line}`"))?;
        Ok(ShimProcess {
            child,
            api: Api {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            },
            log: log.to_owned(),
        })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls the healthcheck every `every` until it answers; fails if the process exits or
    /// `limit` passes (with the end of its log).
    pub fn wait_until_answering(&mut self, limit: Duration, every: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            if self.api.answers() {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "dstack-shim exited ({status}) before answering; end of {}:\n{}",
                    self.log.display(),
                    cmd::tail(&self.log, 30)
                );
            }
            if started.elapsed() > limit {
                bail!(
                    "dstack-shim did not answer within {limit:?}; end of {}:\n{}",
                    self.log.display(),
                    cmd::tail(&self.log, 30)
                );
            }
            sleep(every);
        }
    }

    /// Its resident set size in KiB (`VmRSS` in `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> Result<u64> {
        let path = format!("/proc/{}/status", self.pid());
        let status = fs_err::read_to_string(&path)?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .with_context(|| format!("no VmRSS in {path}"))
    }

    /// SIGKILLs it and reaps it.
    pub fn kill(mut self) -> Result<()> {
        self.child.kill().context("could not kill dstack-shim")?;
        self.child.wait()?;
        Ok(())
    }

    /// Waits (at most `limit`, polling every 2 ms) for it to exit by itself; fails on a
    /// non-zero exit or timeout.
    pub fn wait_exit(mut self, limit: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::ensure!(
                    status.success(),
                    "dstack-shim exited with {status}; end of {}:\n{}",
                    self.log.display(),
                    cmd::tail(&self.log, 30)
                );
                return Ok(());
            }
            if started.elapsed() > limit {
                bail!("dstack-shim did not exit within {limit:?}");
            }
            sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for ShimProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Force-removes every container whose name starts with `prefix` when dropped (the tasks of
/// a demo or bench run all carry the run's unique name prefix), so a failed run leaves nothing
/// behind. Best effort.
pub struct ContainerSweeper {
    /// The name prefix of this run's tasks.
    pub prefix: String,
}

impl ContainerSweeper {
    /// Removes the containers now; returns how many there were.
    pub fn sweep(&self) -> usize {
        let Ok(out) =
            cmd::output(cmd::cmd("docker").args(["ps", "-a", "--format", "{{.ID}} {{.Names}}"]))
        else {
            return 0;
        };
        let ids: Vec<&str> = out
            .lines()
            .filter_map(|line| line.split_once(' '))
            .filter(|(_, name)| name.trim_start_matches('/').starts_with(&self.prefix))
            .map(|(id, _)| id)
            .collect();
        if !ids.is_empty() {
            let _ = cmd::output(cmd::cmd("docker").args(["rm", "-f"]).args(&ids));
        }
        ids.len()
    }
}

impl Drop for ContainerSweeper {
    fn drop(&mut self) {
        let n = self.sweep();
        if n > 0 {
            println!(
                "cleanup: removed {n} leftover container(s) named {}*",
                self.prefix
            );
        }
    }
}

/// Whether Docker knows a container named (or with the id) `name`.
pub fn container_exists(name: &str) -> bool {
    cmd::succeeds(cmd::cmd("docker").args(["inspect", "--type", "container", name]))
}

/// Writes `code` to the runner's exit file of task `id` under `home` (temp file + rename, so
/// the stub runner never reads a half-written file): the stub runner then exits with `code`.
pub fn make_runner_exit(home: &Path, id: &str, code: i32) -> Result<()> {
    let dir = home.join("tasks").join(id).join("runner");
    let tmp = dir.join(".exit.tmp");
    fs_err::write(&tmp, format!("{code}\n"))?;
    fs_err::rename(&tmp, dir.join(shim_e2e::RUNNER_EXIT_FILE))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_answers() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        let r = parse_response(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, r.text().as_str()), (404, "abcde"));
        assert!(parse_response(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Len").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
                .is_err()
        );
    }

    #[test]
    fn request_sends_json_and_reads_the_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !String::from_utf8_lossy(&request).ends_with("{\"a\":1}") {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0, "client closed early");
                request.extend_from_slice(&buf[..n]);
            }
            stream
                .write_all(b"HTTP/1.1 409 Conflict\r\nContent-Length: 4\r\n\r\nbusy")
                .unwrap();
            String::from_utf8(request).unwrap()
        });
        let api = Api { addr };
        let err = api
            .post("/api/tasks", &serde_json::json!({"a": 1}))
            .unwrap_err();
        assert!(format!("{err:#}").contains("got 409: busy"), "{err:#}");
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
}
