//! A raw Docker Engine API client of the bench's own, over the Unix socket
//! (`/var/run/docker.sock`, HTTP/1.1 with the harness's client): what a program that drives
//! Docker directly would do, to compare the shim with. Create, start, kill, inspect, list,
//! remove, and the `/events` stream (read by a thread that stamps each event when it arrives).

use std::io::{BufRead, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};
use shim_e2e::harness::{Body, Request, Response, SseParser, Streamed};

use super::clock::parse_rfc3339_utc;

/// The daemon's socket.
pub const SOCKET: &str = "/var/run/docker.sock";
/// How long the `/events` stream may stay silent (no bound worth the name: a day).
pub const EVENTS_IDLE: Duration = Duration::from_secs(24 * 3600);

/// A client of the daemon at a Unix socket.
#[derive(Debug, Clone)]
pub struct Docker {
    socket: PathBuf,
}

impl Default for Docker {
    /// The daemon of `DOCKER_HOST` (`unix://PATH`) if set, else [`SOCKET`].
    fn default() -> Self {
        Self::new(&socket_path())
    }
}

/// The daemon's socket: `DOCKER_HOST` if it is `unix://PATH`, else [`SOCKET`].
pub fn socket_path() -> PathBuf {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|host| host.strip_prefix("unix://").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(SOCKET))
}

/// Whether `DOCKER_HOST` names another daemon than the default one.
pub fn private_daemon() -> bool {
    socket_path() != Path::new(SOCKET)
}

/// Percent-encodes `s` for a query string.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `{"label":["key=value"]}` and more, encoded for `filters=`.
pub fn filters(pairs: &[(&str, &str)]) -> String {
    let mut map = serde_json::Map::new();
    for (key, value) in pairs {
        let entry = map.entry((*key).to_owned()).or_insert_with(|| json!([]));
        if let Some(list) = entry.as_array_mut() {
            list.push(json!(value));
        }
    }
    encode(&Value::Object(map).to_string())
}

impl Docker {
    /// A client of the daemon at `socket`.
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_owned(),
        }
    }

    fn send(&self, request: Request, expect: &[u16]) -> Result<Response> {
        let what = format!("{request:?}");
        let response = request
            .timeout(Duration::from_secs(120))
            .send_unix(&self.socket)?;
        if !expect.contains(&response.status) {
            bail!(
                "Docker answered {} to {}: {}",
                response.status,
                what.chars().take(200).collect::<String>(),
                response.body.trim()
            );
        }
        Ok(response)
    }

    /// Whether the daemon has the image `reference`.
    pub fn has_image(&self, reference: &str) -> Result<bool> {
        let path = format!("/images/{}/json", encode(reference));
        Ok(self.send(Request::get(&path), &[200, 404])?.status == 200)
    }

    /// `GET /_ping`.
    pub fn ping(&self) -> Result<()> {
        self.send(Request::get("/_ping"), &[200]).map(drop)
    }

    /// Creates a container named `name` from `body` (the Engine API's create body); its id.
    pub fn create(&self, name: &str, body: &Value) -> Result<String> {
        let path = format!("/containers/create?name={}", encode(name));
        let created = self.send(Request::post(&path).json(body), &[201])?.json()?;
        created["Id"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("no Id in {created}"))
    }

    /// Starts a created container.
    pub fn start(&self, id: &str) -> Result<()> {
        self.send(
            Request::post(&format!("/containers/{id}/start")),
            &[204, 304],
        )
        .map(drop)
    }

    /// `GET /containers/{id}/json`.
    pub fn inspect(&self, id: &str) -> Result<Value> {
        Ok(self
            .send(Request::get(&format!("/containers/{id}/json")), &[200])?
            .json()?)
    }

    /// When the container stopped (`State.FinishedAt`).
    pub fn finished_at(&self, id: &str) -> Result<SystemTime> {
        let info = self.inspect(id)?;
        let text = info["State"]["FinishedAt"].as_str().unwrap_or_default();
        parse_rfc3339_utc(text).with_context(|| format!("{id}: bad FinishedAt {text:?}"))
    }

    /// The containers (running or not) labelled `key=value`.
    pub fn list(&self, key: &str, value: &str) -> Result<Vec<Value>> {
        let label = format!("{key}={value}");
        let path = format!(
            "/containers/json?all=1&filters={}",
            filters(&[("label", &label)])
        );
        let list = self.send(Request::get(&path), &[200])?.json()?;
        Ok(list.as_array().cloned().unwrap_or_default())
    }

    /// Force-removes a container (and its anonymous volumes); a missing one is fine.
    pub fn remove(&self, id: &str) -> Result<()> {
        let path = format!("/containers/{id}?force=1&v=1");
        self.send(Request::new("DELETE", &path), &[204, 404])
            .map(drop)
    }

    /// Force-removes every container labelled `key=value`, `threads` at a time; how many.
    pub fn remove_all(&self, key: &str, value: &str, threads: usize) -> Result<usize> {
        let ids: Vec<String> = self
            .list(key, value)?
            .iter()
            .filter_map(|c| c["Id"].as_str().map(str::to_owned))
            .collect();
        let results = parallel(&ids, threads, |id| self.remove(id));
        results.into_iter().collect::<Result<Vec<()>>>()?;
        Ok(ids.len())
    }

    /// Subscribes to `/events` with `filter` pairs (e.g. `("type","container")`,
    /// `("event","die")`); events arrive, stamped, on the returned channel.
    pub fn events(&self, filter: &[(&str, &str)]) -> Result<Events> {
        let path = format!("/events?filters={}", filters(filter));
        // The stream is silent until something happens: reads wait as long as a bench runs.
        let streamed = Request::get(&path)
            .timeout(EVENTS_IDLE)
            .open_unix(&self.socket)?;
        Events::read(streamed, &path, Framing::JsonLines)
    }
}

/// How a stream's body frames its events.
#[derive(Debug, Clone, Copy)]
pub enum Framing {
    /// One JSON object per line (Docker's `/events`).
    JsonLines,
    /// Server-Sent Events: the JSON is on the `data: ` lines (the shim's `/api/events`).
    Sse,
}

/// A stream socket the event reader can shut down.
pub trait Shutdown: Send {
    /// A handle on the same socket (to shut it down while a thread reads it).
    fn handle(&self) -> std::io::Result<Box<dyn Shutdown>>;
    /// Shuts both directions down (the reader thread then ends).
    fn shutdown(&self);
}

impl Shutdown for UnixStream {
    fn handle(&self) -> std::io::Result<Box<dyn Shutdown>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown(&self) {
        let _ = UnixStream::shutdown(self, std::net::Shutdown::Both);
    }
}

impl Shutdown for std::net::TcpStream {
    fn handle(&self) -> std::io::Result<Box<dyn Shutdown>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown(&self) {
        let _ = std::net::TcpStream::shutdown(self, std::net::Shutdown::Both);
    }
}

/// The events of an `/events` subscription, each with when it was read. Dropping it closes
/// the connection (and ends its reader thread).
pub struct Events {
    rx: mpsc::Receiver<(Value, SystemTime)>,
    stream: Box<dyn Shutdown>,
}

impl Events {
    /// Checks that the answer to `GET path` is 200 and starts a thread that reads its body's
    /// events (framed as `framing`), stamping each when it arrives.
    pub fn read<S: Read + Shutdown + 'static>(
        streamed: Streamed<S>,
        path: &str,
        framing: Framing,
    ) -> Result<Self> {
        anyhow::ensure!(
            streamed.status == 200,
            "GET {path} answered {}",
            streamed.status
        );
        let stream = streamed.body.get_ref().get_ref().handle()?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || read_events(streamed.body, framing, &tx));
        Ok(Events { rx, stream })
    }

    /// The next event whose `id` is `id` (others are skipped), within `limit`.
    pub fn wait_for(&self, id: &str, limit: Duration) -> Result<(Value, SystemTime)> {
        self.wait_until(limit, |event| event["id"] == id)
            .with_context(|| format!("no event for container {id}"))
    }

    /// The next event, if one comes within `limit`.
    pub fn next(&self, limit: Duration) -> Result<Option<(Value, SystemTime)>> {
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
        wanted: impl Fn(&Value) -> bool,
    ) -> Result<(Value, SystemTime)> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((event, at)) if wanted(&event) => return Ok((event, at)),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => bail!("no such event within {limit:?}"),
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the event stream ended"),
            }
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.stream.shutdown();
    }
}

/// Reads events (chunked transfer decoded by the harness, framed as `framing`) until the
/// stream ends, each stamped with when its last byte was read.
fn read_events<R: BufRead>(
    mut body: Body<R>,
    framing: Framing,
    tx: &mpsc::Sender<(Value, SystemTime)>,
) {
    let mut pending = Vec::new();
    let mut sse = SseParser::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let at = SystemTime::now();
        let mut values = Vec::new();
        match framing {
            Framing::JsonLines => {
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    values.extend(serde_json::from_slice::<Value>(&line).ok());
                }
            }
            Framing::Sse => {
                sse.push(&buf[..n]);
                while let Some(block) = sse.next_block() {
                    if let Ok(event) = block
                        && !event.is_comment()
                    {
                        values.extend(serde_json::from_str::<Value>(&event.data).ok());
                    }
                }
            }
        }
        for value in values {
            if tx.send((value, at)).is_err() {
                return;
            }
        }
    }
}

/// Runs `f` on every item, `threads` at a time, and returns the results in order.
pub fn parallel<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<R>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(items.len().max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(item) = items.get(i) else { return };
                    let result = f(item);
                    if let Ok(mut slot) = results[i].lock() {
                        *slot = Some(result);
                    }
                }
            });
        }
    });
    results
        .into_iter()
        .filter_map(|slot| slot.into_inner().ok().flatten())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_json_percent_encoded() {
        assert_eq!(encode("a b/c=d"), "a%20b%2Fc%3Dd");
        let f = filters(&[("type", "container"), ("event", "die"), ("event", "start")]);
        let decoded = f
            .replace("%22", "\"")
            .replace("%3A", ":")
            .replace("%2C", ",");
        let decoded = decoded
            .replace("%7B", "{")
            .replace("%7D", "}")
            .replace("%5B", "[")
            .replace("%5D", "]");
        let value: Value = serde_json::from_str(&decoded).unwrap();
        assert_eq!(
            value,
            json!({"type": ["container"], "event": ["die", "start"]})
        );
    }

    #[test]
    fn parallel_keeps_the_order() {
        let items: Vec<u32> = (0..50).collect();
        let out = parallel(&items, 7, |i| i * 2);
        assert_eq!(out, items.iter().map(|i| i * 2).collect::<Vec<_>>());
    }
}
