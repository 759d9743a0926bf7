//! Logs go to stderr and are appended to `<home>/shim.log`, each written by a thread of its
//! own: a log line never blocks the caller (the one async thread) on a frozen or hung home or
//! a stalled journal. Lines beyond a bounded queue are dropped, and said so.

use std::io::{IsTerminal as _, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use fs_err::os::unix::fs::OpenOptionsExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// The log file's name in the home.
pub const LOG_FILE: &str = "shim.log";

/// Installs the global subscriber: `level` (or `RUST_LOG` when set) to stderr and to
/// `<home>/shim.log` (append, created 0600), as text lines or, with [`LogFormat::Json`], one
/// JSON object per line whose fields (task ids, errors, …) are keys of their own.
pub fn init(level: LevelFilter, format: LogFormat, home: &Path) -> anyhow::Result<()> {
    let path = home.join(LOG_FILE);
    let file = fs_err::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .context("cannot open the log file")?;
    let json = format == LogFormat::Json;
    let queues = [
        Queue::spawn("log-stderr", std::io::stderr(), json)?,
        Queue::spawn("log-file", file, json)?,
    ];
    let [stderr, file] = queues.clone();
    // A second init (the watchdog's) keeps the first's queues: its logger is refused anyway.
    let _ = QUEUES.set(queues);
    let filter = if std::env::var_os(EnvFilter::DEFAULT_ENV).is_some() {
        EnvFilter::builder()
            .with_default_directive(level.into())
            .from_env()
            .context("invalid RUST_LOG")?
    } else {
        own_crates_at(level)?
    };
    let registry = tracing_subscriber::registry().with(filter);
    let installed = match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(stderr),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(file),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(stderr),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(file),
            )
            .try_init(),
    };
    installed.context("cannot install the logger")?;
    Ok(())
}

/// How many lines a destination's queue holds while its writer is behind.
const QUEUE_LINES: usize = 1024;

/// How long [`flush`] waits for the queued lines to be written.
const FLUSH_BOUND: Duration = Duration::from_secs(2);

/// The installed logger's queues (stderr, the file), for [`flush`].
static QUEUES: OnceLock<[Queue; 2]> = OnceLock::new();

/// Waits (at most 2 s: a destination may be hung) until the lines logged so far are written:
/// before the process exits or replaces itself.
pub fn flush() {
    let until = Instant::now() + FLUSH_BOUND;
    for queue in QUEUES.get().into_iter().flatten() {
        queue.drain(until);
    }
}

/// Log lines on their way to one destination, written in order by a thread of its own.
#[derive(Clone)]
struct Queue(Arc<Shared>);

struct Shared {
    lines: SyncSender<Vec<u8>>,
    /// Lines queued and not yet written.
    pending: AtomicUsize,
    /// Lines dropped (the queue was full) since the writer last said so.
    dropped: AtomicU64,
}

impl Queue {
    /// A queue to `out`, its writer thread named `name`; the notice of dropped lines is a
    /// JSON object where `json`.
    fn spawn(name: &str, out: impl Write + Send + 'static, json: bool) -> anyhow::Result<Self> {
        let (lines, received) = std::sync::mpsc::sync_channel::<Vec<u8>>(QUEUE_LINES);
        let shared = Arc::new(Shared {
            lines,
            pending: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
        });
        let queue = Arc::downgrade(&shared);
        let mut out = std::io::BufWriter::new(out);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                for line in received {
                    let Some(queue) = queue.upgrade() else { return };
                    let _ = out.write_all(&line);
                    // Lines were dropped after those queued: said once these are written.
                    let caught_up = queue.pending.load(Ordering::Acquire) == 1;
                    let dropped = match caught_up {
                        true => queue.dropped.swap(0, Ordering::Relaxed),
                        false => 0,
                    };
                    if dropped > 0 {
                        let _ = out.write_all(dropped_notice(dropped, json).as_bytes());
                    }
                    let _ = out.flush();
                    queue.pending.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .context("cannot start the logger's writer")?;
        Ok(Self(shared))
    }

    /// Queues `line`, or drops it when the queue is full.
    fn send(&self, line: Vec<u8>) {
        self.0.pending.fetch_add(1, Ordering::AcqRel);
        if self.0.lines.try_send(line).is_err() {
            self.0.pending.fetch_sub(1, Ordering::AcqRel);
            self.0.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until nothing is queued, or `until`; whether it got there.
    fn drain(&self, until: Instant) -> bool {
        while self.0.pending.load(Ordering::Acquire) > 0 {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// The line that says `dropped` lines were dropped, in the shape of the others (a timestamp,
/// the level, this module's target, the message; a JSON object with those keys where `json`).
fn dropped_notice(dropped: u64, json: bool) -> String {
    use tracing_subscriber::fmt::time::FormatTime as _;
    let mut at = String::new();
    let _ = tracing_subscriber::fmt::time::SystemTime
        .format_time(&mut tracing_subscriber::fmt::format::Writer::new(&mut at));
    let message = format!("{dropped} log line(s) dropped: this destination was too slow");
    match json {
        true => format!(
            "{{\"timestamp\":\"{at}\",\"level\":\"WARN\",\"message\":\"{message}\",\"target\":\"{}\"}}\n",
            module_path!()
        ),
        false => format!("{at}  WARN {}: {message}\n", module_path!()),
    }
}

/// One event's formatted text, queued whole when the layer is done with it.
struct Line<'a> {
    queue: &'a Queue,
    bytes: Vec<u8>,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if !self.bytes.is_empty() {
            self.queue.send(std::mem::take(&mut self.bytes));
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Queue {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line {
            queue: self,
            bytes: Vec::new(),
        }
    }
}

/// The crates of this workspace, by their tracing targets.
const OWN_CRATES: [&str; 11] = [
    "dstack_shim",
    "shim_components",
    "shim_dcgm",
    "shim_engine",
    "shim_fs",
    "shim_http",
    "shim_resources",
    "shim_runtime",
    "shim_store",
    "shim_task",
    "shim_util",
];

/// `level` for this workspace's crates; the libraries under them (hyper's connection pool
/// logs two lines a Docker request at debug) at `info` at most, unless `level` is `trace`.
/// The dstack server starts every shim at debug (level 5), as it does upstream's, whose
/// debug log has no such lines.
fn own_crates_at(level: LevelFilter) -> anyhow::Result<EnvFilter> {
    let others = if level == LevelFilter::TRACE {
        level
    } else {
        level.min(LevelFilter::INFO)
    };
    OWN_CRATES.iter().try_fold(
        EnvFilter::default().add_directive(others.into()),
        |filter, krate| {
            let directive = format!("{krate}={level}").parse()?;
            Ok(filter.add_directive(directive))
        },
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::mpsc::Receiver;

    use super::*;

    /// A destination that takes a write only when the test lets it (a frozen disk, a stalled
    /// journal), and records what it got.
    struct Gated {
        gate: Arc<Mutex<Receiver<()>>>,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Gated {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.gate.lock().unwrap().recv();
            self.got.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    // A destination that takes nothing does not hold the caller: lines go to the queue, those
    // beyond it are dropped and said so once it moves again, and a flush waits a bounded
    // while. The logger used to write on the caller's thread, so a frozen home stalled the
    // one async thread, and with it every answer.
    #[test]
    fn a_stalled_destination_holds_no_caller_and_drops_what_it_cannot_keep() {
        let (open, gate) = std::sync::mpsc::channel();
        let got = Arc::new(Mutex::new(Vec::new()));
        let out = Gated {
            gate: Arc::new(Mutex::new(gate)),
            got: got.clone(),
        };
        let queue = Queue::spawn("test-log", out, false).unwrap();
        let started = Instant::now();
        for n in 0..QUEUE_LINES + 50 {
            let mut line = tracing_subscriber::fmt::MakeWriter::make_writer(&queue);
            writeln!(line, "line {n}").unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the caller waited"
        );
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(!queue.drain(soon), "nothing could be written yet");
        for _ in 0..10_000 {
            open.send(()).unwrap();
        }
        assert!(queue.drain(Instant::now() + Duration::from_secs(10)));
        let got = String::from_utf8(got.lock().unwrap().clone()).unwrap();
        assert!(got.starts_with("line 0\n"), "{got:.40}");
        let kept = got.lines().filter(|l| l.starts_with("line ")).count();
        assert!((QUEUE_LINES..QUEUE_LINES + 50).contains(&kept), "{kept}");
        let dropped = QUEUE_LINES + 50 - kept;
        let notice = format!(
            "  WARN dstack_shim::logging: {dropped} log line(s) dropped: this destination was too slow\n"
        );
        assert!(got.ends_with(&notice), "{got}");
        let last = got.lines().last().unwrap_or_default();
        assert!(last.starts_with("20") && last.contains("Z  WARN"), "{last}");
        let json: serde_json::Value =
            serde_json::from_str(dropped_notice(3, true).trim_end()).unwrap();
        assert_eq!(json["target"], "dstack_shim::logging");
        assert_eq!(json["level"], "WARN");
        assert!(json["timestamp"].as_str().unwrap().ends_with('Z'), "{json}");
        let message = "3 log line(s) dropped: this destination was too slow";
        assert_eq!(json["message"], message);
    }
}
