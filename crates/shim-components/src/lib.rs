//! The shim's components: the `dstack-runner` binary (bind-mounted into every task container)
//! and the `dstack-shim` binary itself.
//!
//! [`Components`] reports each one's state (`GET /api/components`) and installs a new binary
//! from a URL (`POST /api/components/install`): the download is streamed into a temporary file
//! (0755) beside the target, fsynced and renamed over the target, and the directory fsynced
//! (`shim_fs::write_atomic_with`), so a reader of the path sees the old binary or the new one,
//! never a partial file. Replacing the running
//! shim's own binary is safe: the running process keeps the old inode until it is restarted.
//!
//! Downloads use `ureq` (blocking, in `spawn_blocking`) over http or https (rustls with the
//! webpki roots; the usual `http(s)_proxy` variables apply). URLs are logged without their
//! query string (presigned URLs carry credentials there).
//!
//! A binary's version is read from `<binary> --version` (output `... version X`), with a
//! timeout.

use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use shim_http::{ApiError, ComponentInfo, ComponentName, ComponentStatus, ComponentsApi};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Where the components live and how long things may take.
#[derive(Debug, Clone)]
pub struct ComponentsConfig {
    /// The runner binary (`--runner-binary-path`).
    pub runner_path: PathBuf,
    /// The shim binary (`--shim-binary-path`, default: the running executable).
    pub shim_path: PathBuf,
    /// How long `<binary> --version` may take.
    pub version_timeout: Duration,
    /// How long a whole download may take.
    pub download_timeout: Duration,
    /// The largest binary accepted.
    pub max_download_bytes: u64,
}

impl ComponentsConfig {
    /// Defaults: 5 s for `--version`, 20 min per download, at most 1 GiB.
    pub fn new(runner_path: impl Into<PathBuf>, shim_path: impl Into<PathBuf>) -> Self {
        Self {
            runner_path: runner_path.into(),
            shim_path: shim_path.into(),
            version_timeout: Duration::from_secs(5),
            download_timeout: Duration::from_secs(20 * 60),
            max_download_bytes: 1 << 30,
        }
    }
}

/// Why reading a version or installing a component failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An install of this component is already running.
    #[error("{name} is already installing")]
    AlreadyInstalling {
        /// The component.
        name: ComponentName,
    },
    /// The URL cannot be used.
    #[error("cannot install {name}: {why}")]
    BadUrl {
        /// The component.
        name: ComponentName,
        /// What is wrong.
        why: String,
    },
    /// The HTTP request failed (connection, TLS, status code, timeout).
    #[error("cannot download {name} from {url}")]
    Download {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// Why.
        #[source]
        source: Box<ureq::Error>,
    },
    /// Reading the response body failed.
    #[error("cannot download {name} from {url}")]
    Body {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The download is larger than allowed, or empty.
    #[error("download of {name} from {url} has a bad size: {why}")]
    Size {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// Writing the binary into place failed (the target is left as it was).
    #[error(transparent)]
    Fs(#[from] shim_fs::Error),
    /// A file operation failed.
    #[error("cannot {op} {}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The install was cancelled (shutdown).
    #[error("install of {name} was cancelled")]
    Cancelled {
        /// The component.
        name: ComponentName,
    },
    /// The background download task died.
    #[error("the install task of {name} failed")]
    Join {
        /// The component.
        name: ComponentName,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
    /// `<binary> --version` failed or printed no version.
    #[error("{} does not report a version: {why}", path.display())]
    Version {
        /// The binary.
        path: PathBuf,
        /// What happened.
        why: String,
    },
}

/// The URL without query string and fragment, for logs and messages.
pub fn redact_url(url: &str) -> String {
    let end = url.find(['?', '#']).unwrap_or(url.len());
    let mut shown = url[..end].to_owned();
    // Drop `user:password@` as well.
    if let Some(scheme_end) = shown.find("://") {
        let rest = &shown[scheme_end + 3..];
        let host_end = rest.find('/').unwrap_or(rest.len());
        if let Some(at) = rest[..host_end].rfind('@') {
            shown = format!("{}{}", &shown[..scheme_end + 3], &rest[at + 1..]);
        }
    }
    shown
}

/// Extracts `X` from `... version X ...` (the first line that has it).
pub fn parse_version(output: &str) -> Option<String> {
    output.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w.eq_ignore_ascii_case("version") {
                return words.next().map(str::to_owned);
            }
        }
        None
    })
}

/// Runs `<path> --version` (killed after `timeout`) and parses its output.
pub async fn binary_version(path: &Path, timeout: Duration) -> Result<String, Error> {
    let verr = |why: String| Error::Version {
        path: path.to_path_buf(),
        why,
    };
    let child = tokio::process::Command::new(path)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(timeout, child)
        .await
        .map_err(|_| verr(format!("no answer within {timeout:?}")))?
        .map_err(|e| verr(format!("cannot run it: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(verr(format!("{}: {}", out.status, stderr.trim())));
    }
    parse_version(&stdout)
        .or_else(|| parse_version(&stderr))
        .ok_or_else(|| verr(format!("unexpected output {:?}", stdout.trim())))
}

#[derive(Debug, Default)]
struct SlotState {
    installing: bool,
    last_error: Option<String>,
    /// The last `--version` answer, valid while the file is the same (device, inode, size,
    /// mtime): the server polls the component list, and a binary does not change its version
    /// without changing its file.
    cached: Option<(FileKey, String)>,
}

/// Identifies one version of a file on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileKey {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        }
    }
}

#[derive(Debug)]
struct Slot {
    path: PathBuf,
    state: Mutex<SlotState>,
}

impl Slot {
    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug)]
struct Inner {
    config: ComponentsConfig,
    runner: Slot,
    shim: Slot,
    /// Number of installs in flight.
    jobs: watch::Sender<usize>,
    cancel: CancellationToken,
}

/// The component manager. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct Components {
    inner: Arc<Inner>,
}

/// Decrements the in-flight count and clears `installing` when an install ends, however.
struct JobGuard {
    inner: Arc<Inner>,
    name: ComponentName,
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        self.inner.slot(self.name).state().installing = false;
        self.inner.jobs.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Inner {
    fn slot(&self, name: ComponentName) -> &Slot {
        match name {
            ComponentName::Runner => &self.runner,
            ComponentName::Shim => &self.shim,
        }
    }
}

impl Components {
    /// A manager for the binaries at the configured paths.
    pub fn new(config: ComponentsConfig) -> Self {
        let slot = |path: &Path| Slot {
            path: path.to_path_buf(),
            state: Mutex::new(SlotState::default()),
        };
        Self {
            inner: Arc::new(Inner {
                runner: slot(&config.runner_path),
                shim: slot(&config.shim_path),
                config,
                jobs: watch::channel(0).0,
                cancel: CancellationToken::new(),
            }),
        }
    }

    /// The path of a component's binary.
    pub fn path(&self, name: ComponentName) -> &Path {
        &self.inner.slot(name).path
    }

    /// A component's state: `installing` while a download runs; `not-installed` when there is
    /// no binary (`error` if the last install failed); `installed` with its version when
    /// `--version` answers; `error` otherwise.
    pub async fn info(&self, name: ComponentName) -> ComponentInfo {
        let slot = self.inner.slot(name);
        let (installing, last_error) = {
            let st = slot.state();
            (st.installing, st.last_error.clone())
        };
        let status = |status, version: String| ComponentInfo {
            name,
            version,
            status,
        };
        if installing {
            return status(ComponentStatus::Installing, String::new());
        }
        let key = match tokio::fs::metadata(&slot.path).await {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return if last_error.is_some() {
                    status(ComponentStatus::Error, String::new())
                } else {
                    status(ComponentStatus::NotInstalled, String::new())
                };
            }
            Err(e) => {
                tracing::warn!(component = %name, error = %e, "cannot inspect the binary");
                return status(ComponentStatus::Error, String::new());
            }
            Ok(meta) => FileKey::of(&meta),
        };
        if let Some((cached_key, version)) = &slot.state().cached {
            if *cached_key == key {
                return status(ComponentStatus::Installed, version.clone());
            }
        }
        match binary_version(&slot.path, self.inner.config.version_timeout).await {
            Ok(v) => {
                slot.state().cached = Some((key, v.clone()));
                status(ComponentStatus::Installed, v)
            }
            Err(e) => {
                tracing::warn!(component = %name, error = %e, "cannot read the version");
                status(ComponentStatus::Error, String::new())
            }
        }
    }

    /// Starts installing `name` from `url` in the background; returns at once.
    pub fn start_install(&self, name: ComponentName, url: &str) -> Result<(), Error> {
        let guard = self.begin(name, url)?;
        let this = self.clone();
        let url = url.to_owned();
        tokio::spawn(async move {
            let _guard = guard;
            if let Err(e) = this.run_install(name, &url).await {
                tracing::error!(component = %name, error = %error_chain(&e), "component install failed");
            }
        });
        Ok(())
    }

    /// Installs `name` from `url` and waits for it (e.g. the runner at startup when it is
    /// missing and a download URL is configured).
    pub async fn install(&self, name: ComponentName, url: &str) -> Result<(), Error> {
        let _guard = self.begin(name, url)?;
        self.run_install(name, url).await
    }

    /// Waits until no install is running.
    pub async fn wait_idle(&self) {
        let mut rx = self.inner.jobs.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Cancels running downloads (their temp files are removed, the targets left untouched).
    pub fn cancel(&self) {
        self.inner.cancel.cancel();
    }

    fn begin(&self, name: ComponentName, url: &str) -> Result<JobGuard, Error> {
        if url.is_empty() {
            return Err(Error::BadUrl {
                name,
                why: "empty url".into(),
            });
        }
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(Error::BadUrl {
                name,
                why: format!("only http and https are supported: {}", redact_url(url)),
            });
        }
        {
            let mut st = self.inner.slot(name).state();
            if st.installing {
                return Err(Error::AlreadyInstalling { name });
            }
            st.installing = true;
        }
        self.inner.jobs.send_modify(|n| *n += 1);
        Ok(JobGuard {
            inner: self.inner.clone(),
            name,
        })
    }

    async fn run_install(&self, name: ComponentName, url: &str) -> Result<(), Error> {
        let slot = self.inner.slot(name);
        tracing::info!(component = %name, url = %redact_url(url), path = %slot.path.display(),
            "installing component");
        let target = slot.path.clone();
        let config = self.inner.config.clone();
        let cancel = self.inner.cancel.clone();
        let owned_url = url.to_owned();
        let result = tokio::task::spawn_blocking(move || {
            download(name, &owned_url, &target, &config, &cancel)
        })
        .await
        .unwrap_or_else(|source| Err(Error::Join { name, source }));
        match &result {
            Ok(()) => {
                slot.state().last_error = None;
                tracing::info!(component = %name, path = %slot.path.display(), "component installed");
            }
            Err(e) => slot.state().last_error = Some(error_chain(e)),
        }
        result
    }
}

/// `error: cause: cause` on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

fn download(
    name: ComponentName,
    url: &str,
    target: &Path,
    config: &ComponentsConfig,
    cancel: &CancellationToken,
) -> Result<(), Error> {
    let io_err = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source: io::Error| Error::Io { op, path, source }
    };
    let shown = redact_url(url);
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs_err::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;

    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(config.download_timeout))
        .timeout_connect(Some(Duration::from_secs(30)))
        .build()
        .into();
    let response = agent.get(url).call().map_err(|e| Error::Download {
        name,
        url: shown.clone(),
        source: Box::new(e),
    })?;
    let mut reader = response.into_body().into_reader();

    // Temp file beside the target (0755 from the start), streamed, fsynced, renamed over the
    // target, directory fsynced: a reader of the path sees the old binary or the new one.
    shim_fs::write_atomic_with(target, &shim_fs::WriteOptions::new(0o755), |file| {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if cancel.is_cancelled() {
                return Err(Error::Cancelled { name });
            }
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(Error::Body {
                        name,
                        url: shown.clone(),
                        source,
                    });
                }
            };
            if file.written() + n as u64 > config.max_download_bytes {
                return Err(Error::Size {
                    name,
                    url: shown.clone(),
                    why: format!("larger than {} bytes", config.max_download_bytes),
                });
            }
            file.write_all(&buf[..n])?;
        }
        if file.written() == 0 {
            return Err(Error::Size {
                name,
                url: shown.clone(),
                why: "empty".into(),
            });
        }
        Ok(())
    })
}

#[async_trait]
impl ComponentsApi for Components {
    async fn list(&self) -> Vec<ComponentInfo> {
        let (runner, shim) = tokio::join!(
            self.info(ComponentName::Runner),
            self.info(ComponentName::Shim)
        );
        vec![runner, shim]
    }

    async fn install(&self, name: ComponentName, url: String) -> Result<(), ApiError> {
        self.start_install(name, &url).map_err(|e| match e {
            Error::AlreadyInstalling { .. } => ApiError::conflict(e.to_string()),
            Error::BadUrl { .. } => ApiError::bad_request(e.to_string()),
            other => ApiError::internal(other.to_string()).with_source(other),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(
            parse_version("dstack-runner version 1.2.3\n").as_deref(),
            Some("1.2.3")
        );
        assert_eq!(
            parse_version("banner\ndstack-shim version 0.19.1 (abc)\n").as_deref(),
            Some("0.19.1")
        );
        assert_eq!(parse_version("no version here?").as_deref(), Some("here?"));
        assert_eq!(parse_version("1.2.3"), None);
        assert_eq!(parse_version("dstack-runner version"), None);
    }

    #[test]
    fn redacts() {
        assert_eq!(
            redact_url("https://b.s3.amazonaws.com/r/dstack-runner?X-Amz-Signature=abc"),
            "https://b.s3.amazonaws.com/r/dstack-runner"
        );
        assert_eq!(redact_url("http://u:pw@h:1/p#f"), "http://h:1/p");
        assert_eq!(redact_url("http://h/p@x"), "http://h/p@x");
    }
}
