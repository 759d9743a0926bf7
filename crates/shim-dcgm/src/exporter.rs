//! [`DcgmExporter`]: `dcgm-exporter` as a supervised child, and the task metrics read from it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::DcgmError;
use crate::config::DcgmConfig;
use crate::counters::{COUNTERS, counters_csv};
use crate::prom::filter_metrics;
use crate::supervisor::{ChildSpec, Supervisor};
use shim_util::BoxError;
use shim_util::{Command, CommandRunner, SystemCommandRunner, error_chain};

/// The most the exporter's answer may weigh (8 GPUs × 49 fields is about 150 KiB).
const MAX_BODY_BYTES: usize = 32 << 20;

/// `dcgm-exporter`, started and kept running by the shim, and a client of its `/metrics`.
///
/// Command line, as upstream (`runner/internal/shim/dcgm/exporter.go`, `Start`):
/// `dcgm-exporter -f <collectors.csv> -a localhost:<port> -c <interval ms>`, where the
/// collectors file (`<state dir>/dcgm-exporter-counters.csv`, or without a state directory a
/// temporary `dstack-dcgm-counters-*.csv` removed when the exporter stops) lists
/// [`COUNTERS`]. Unlike upstream, an exporter that exits is restarted with backoff.
#[derive(Debug)]
pub struct DcgmExporter {
    supervisor: Supervisor,
    counters_path: PathBuf,
    /// Removes the collectors file when dropped; taken by shutdown.
    counters: std::sync::Mutex<Option<tempfile::TempPath>>,
    url: String,
    port: u16,
    fetch_timeout: Duration,
    interval: Duration,
    /// The last successful answer and when it was fetched.
    cache: Mutex<Option<(Instant, Arc<str>)>>,
}

impl DcgmExporter {
    /// Upstream's start-up: find the binary ([`DcgmConfig::find_exporter`]), check that
    /// `<binary> -v` exits 0 (`GetDCGMExporterExecPath`), then [`DcgmExporter::spawn`] it.
    /// `None` (logged) when it is missing or unusable: `/metrics/tasks/{id}` then answers 404.
    /// Call it on NVIDIA hosts only, as upstream does.
    pub async fn start(config: &DcgmConfig) -> Option<Self> {
        let Some(path) = config.find_exporter() else {
            tracing::info!("not using DCGM Exporter: dcgm-exporter not found");
            return None;
        };
        let runner = SystemCommandRunner::default();
        if let Err(e) = check_version(&runner, &path, config.command_timeout).await {
            tracing::warn!(error = %error_chain(&e), "not using DCGM Exporter");
            return None;
        }
        match Self::spawn(&path, config) {
            Ok(exporter) => {
                tracing::info!(url = %exporter.url, "using DCGM Exporter");
                Some(exporter)
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "not using DCGM Exporter");
                None
            }
        }
    }

    /// Writes the collectors file and starts supervising `program` with upstream's command
    /// line. Returns at once; the exporter answers once it has started (until then, fetches
    /// fail). Must be called inside a tokio runtime.
    pub fn spawn(program: &Path, config: &DcgmConfig) -> Result<Self, DcgmError> {
        let (counters_path, counters) = write_counters(config.state_dir.as_deref())?;
        let listen = format!("localhost:{}", config.exporter_http_port);
        let args = vec![
            "-f".into(),
            counters_path.clone().into_os_string(),
            "-a".into(),
            listen.clone().into(),
            "-c".into(),
            config.exporter_interval.as_millis().to_string().into(),
        ];
        let supervisor = Supervisor::spawn(ChildSpec::new("dcgm-exporter", program, args, config));
        Ok(Self {
            supervisor,
            counters_path,
            counters: std::sync::Mutex::new(counters),
            url: format!("http://{listen}/metrics"),
            port: config.exporter_http_port,
            fetch_timeout: config.fetch_timeout,
            interval: config.exporter_interval,
            cache: Mutex::new(None),
        })
    }

    /// The URL fetched: `http://localhost:<port>/metrics`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The collectors file given with `-f`.
    pub fn counters_path(&self) -> &Path {
        &self.counters_path
    }

    /// The running exporter's pid (`None` between a crash and its restart).
    pub fn pid(&self) -> Option<u32> {
        self.supervisor.pid()
    }

    /// How many times the exporter was started (1 + restarts).
    pub fn starts(&self) -> u64 {
        self.supervisor.starts()
    }

    /// The exporter's whole answer. An answer younger than the collect interval is reused
    /// (upstream `Fetch`: the exporter has nothing newer anyway); failures are not cached.
    pub async fn fetch(&self) -> Result<Arc<str>, DcgmError> {
        let mut cache = self.cache.lock().await;
        if let Some((at, body)) = cache.as_ref()
            && at.elapsed() < self.interval
        {
            return Ok(body.clone());
        }
        let now = Instant::now();
        let body: Arc<str> = self.get().await?.into();
        *cache = Some((now, body.clone()));
        Ok(body)
    }

    /// The samples of the given GPUs (ids as in the task's `gpu_ids`: NVIDIA UUIDs) in
    /// Prometheus text, with the `# HELP`/`# TYPE` lines of their families; see
    /// [`filter_metrics`]. As upstream, the exporter is asked even for a task without GPUs
    /// (which gets an empty body), so an exporter failure is reported either way.
    pub async fn fetch_task_metrics(&self, gpu_ids: &[String]) -> Result<String, DcgmError> {
        let body = self.fetch().await?;
        Ok(filter_metrics(&body, gpu_ids))
    }

    /// Stops the exporter (SIGTERM, SIGKILL after the grace period) and removes the
    /// collectors file. Fetches fail afterwards; later calls do nothing.
    pub async fn shutdown(&self) {
        self.supervisor.shutdown().await;
        if let Some(Err(e)) = crate::take(&self.counters).map(tempfile::TempPath::close) {
            tracing::warn!(error = %e, "failed to remove the dcgm-exporter collectors file");
        }
    }

    async fn get(&self) -> Result<String, DcgmError> {
        let url = self.url.clone();
        let fetch = http_get("localhost", self.port, "/metrics");
        match tokio::time::timeout(self.fetch_timeout, fetch).await {
            Err(_) => Err(DcgmError::FetchTimeout {
                url,
                timeout: self.fetch_timeout,
            }),
            Ok(Err(source)) => Err(DcgmError::Fetch { url, source }),
            Ok(Ok((200, body))) => Ok(String::from_utf8_lossy(&body).into_owned()),
            Ok(Ok((status, _))) => Err(DcgmError::Status { url, status }),
        }
    }
}

/// Upstream's check that the binary works: `<binary> -v` exits 0.
pub(crate) async fn check_version(
    runner: &dyn CommandRunner,
    program: &Path,
    timeout: Duration,
) -> Result<(), DcgmError> {
    let version = Command::new(program).arg("-v").timeout(timeout);
    let out = runner.run(&version).await?.check(&version)?;
    tracing::debug!(path = %program.display(), version = out.stdout.trim(), "detected");
    Ok(())
}

/// Writes the collectors file: `<state_dir>/dcgm-exporter-counters.csv` (written again at
/// each start, kept: every restart of the exporter reads it, and a file in `/tmp` untouched
/// for days is what the system's temp cleaner deletes), or without a state directory a
/// temporary `dstack-dcgm-counters-*.csv`, removed at shutdown (the second value).
fn write_counters(
    state_dir: Option<&Path>,
) -> Result<(PathBuf, Option<tempfile::TempPath>), DcgmError> {
    let err = |source| DcgmError::CountersFile { source };
    let csv = counters_csv(COUNTERS);
    if let Some(dir) = state_dir {
        // Replaced whole (written beside, renamed over): a restart of a supervised exporter
        // never reads half a file. Written again at every start, so no fsync.
        let path = dir.join(COUNTERS_FILE);
        let tmp = dir.join(format!(".{COUNTERS_FILE}.tmp"));
        fs_err::write(&tmp, csv.as_bytes()).map_err(err)?;
        fs_err::rename(&tmp, &path).map_err(err)?;
        return Ok((path, None));
    }
    let mut file = tempfile::Builder::new()
        .prefix(&format!("{}counters-", crate::scratch::PREFIX))
        .suffix(".csv")
        .tempfile()
        .map_err(err)?;
    file.write_all(csv.as_bytes()).map_err(err)?;
    file.flush().map_err(err)?;
    let temp = file.into_temp_path();
    Ok((temp.to_path_buf(), Some(temp)))
}

/// The collectors file's name in the state directory.
const COUNTERS_FILE: &str = "dcgm-exporter-counters.csv";

/// One `GET` over a fresh HTTP/1.1 connection: the status and the whole body (at most
/// [`MAX_BODY_BYTES`]). `host` may resolve to several addresses; each is tried in turn.
async fn http_get(host: &str, port: u16, path: &str) -> Result<(u16, Bytes), BoxError> {
    let stream = tokio::net::TcpStream::connect((host, port)).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let conn = tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "exporter connection failed");
        }
    });
    let request = http::Request::get(path)
        .header(http::header::HOST, format!("{host}:{port}"))
        .body(Empty::<Bytes>::new())?;
    let result = async {
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await?
            .to_bytes();
        Ok::<_, BoxError>((status, body))
    }
    .await;
    conn.abort();
    result
}
