//! The component manager: one slot per component (its path, whether an install runs, the last
//! install error, the cached version), background installs and their shutdown.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use shim_util::{SystemCommandRunner, error_chain};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::download::{check_url_present, download, redact_url};
use crate::version::{FileKey, binary_version};
use crate::{ComponentInfo, ComponentName, ComponentStatus, ComponentsError};

/// Where the components live and how long things may take.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ComponentsConfig {
    /// The runner binary (`--runner-binary-path`).
    pub runner_path: PathBuf,
    /// The shim binary (`--shim-binary-path`, default: the running executable).
    pub shim_path: PathBuf,
    /// How long `<binary> --version` may take.
    pub version_timeout: Duration,
    /// How long a whole download may take.
    pub download_timeout: Duration,
    /// How long a download may receive nothing before it fails (a connection that stalled
    /// mid-file would otherwise hold the install, and a shutdown waiting for it, for the
    /// whole `download_timeout`).
    pub stall_timeout: Duration,
    /// The largest binary accepted.
    pub max_download_bytes: u64,
    /// The shim's home, where an upgrade's rollback record is kept
    /// ([`crate::upgrade::RollbackRecord`]); set by the binary that upgrades in place. With
    /// it, a shim download is fetched beside the path and put there only if the record does
    /// not refuse it and it answers `--version` ([`ComponentsError::Unusable`] when it does
    /// not), so that what systemd starts at the next restart or reboot runs (`None`: neither).
    pub rollback_home: Option<PathBuf>,
}

impl ComponentsConfig {
    /// Defaults: 5 s for `--version`, 20 min per download and 60 s without a byte, at most
    /// 1 GiB.
    pub fn new(runner_path: impl Into<PathBuf>, shim_path: impl Into<PathBuf>) -> Self {
        Self {
            runner_path: runner_path.into(),
            shim_path: shim_path.into(),
            version_timeout: Duration::from_secs(5),
            download_timeout: Duration::from_secs(20 * 60),
            stall_timeout: Duration::from_secs(60),
            max_download_bytes: 1 << 30,
            rollback_home: None,
        }
    }
}

#[derive(Debug, Default)]
struct SlotState {
    installing: bool,
    last_error: Option<String>,
    /// Set when the binary at the path is not what the last install put there because that
    /// one was rolled back (it did not start): the component reports `error` whatever the
    /// file now holds, until the next install begins.
    rolled_back: Option<String>,
    /// The last `--version` answer, valid while the file is the same: the server polls the
    /// component list.
    cached: Option<(FileKey, String)>,
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

    /// The state of every component, runner first (`GET /api/components`).
    pub async fn list(&self) -> Vec<ComponentInfo> {
        let (runner, shim) = tokio::join!(
            self.info(ComponentName::Runner),
            self.info(ComponentName::Shim)
        );
        vec![runner, shim]
    }

    /// A component's state: `installing` while a download runs; `error` after an install
    /// that was rolled back ([`Components::mark_rolled_back`]); `not-installed` when there is
    /// no binary (`error` if the last install failed); `installed` with its version when
    /// `--version` answers; `error` otherwise.
    pub async fn info(&self, name: ComponentName) -> ComponentInfo {
        let slot = self.inner.slot(name);
        let (installing, last_error, rolled_back) = {
            let st = slot.state();
            (
                st.installing,
                st.last_error.clone(),
                st.rolled_back.is_some(),
            )
        };
        let status = |status, version: String| ComponentInfo {
            name,
            version,
            status,
        };
        if installing {
            return status(ComponentStatus::Installing, String::new());
        }
        if rolled_back {
            return status(ComponentStatus::Error, String::new());
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
                tracing::warn!(component = %name, error = %error_chain(&e), "cannot inspect the binary");
                return status(ComponentStatus::Error, String::new());
            }
            Ok(meta) => FileKey::of(&meta),
        };
        if let Some((cached_key, version)) = &slot.state().cached
            && *cached_key == key
        {
            return status(ComponentStatus::Installed, version.clone());
        }
        let runner = SystemCommandRunner::default();
        let timeout = self.inner.config.version_timeout;
        match binary_version(&runner, &slot.path, name.as_str(), timeout).await {
            Ok(v) => {
                slot.state().cached = Some((key, v.clone()));
                status(ComponentStatus::Installed, v)
            }
            Err(e) => {
                tracing::warn!(component = %name, error = %error_chain(&e), "cannot read the version");
                status(ComponentStatus::Error, String::new())
            }
        }
    }

    /// Starts installing `name` from `url` in the background; returns at once
    /// (`POST /api/components/install`). [`ComponentsError::BadUrl`] for an empty URL,
    /// [`ComponentsError::AlreadyInstalling`] while an install of `name` runs. A URL that is not http or
    /// https is accepted and fails in the background, as upstream's download fails (the
    /// component then reports what its check finds: `error` when no binary is left).
    pub fn start_install(&self, name: ComponentName, url: &str) -> Result<(), ComponentsError> {
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
    /// missing and a download URL is configured). The install runs in a task of its own:
    /// dropping this future does not cut it short (its download, the installed shim's check
    /// and rollback still run, and [`Components::wait_idle`] waits for them);
    /// [`Components::cancel`] stops it.
    pub async fn install(&self, name: ComponentName, url: &str) -> Result<(), ComponentsError> {
        let guard = self.begin(name, url)?;
        let this = self.clone();
        let url = url.to_owned();
        tokio::spawn(async move {
            let _guard = guard;
            this.run_install(name, &url).await
        })
        .await
        .unwrap_or_else(|source| Err(ComponentsError::Join { name, source }))
    }

    /// Records that the binary the last install of `name` put in place was rolled back
    /// (`why`): the component reports `error` until the next install begins, whatever the
    /// restored file answers (the dstack server then sees no installed version to restart
    /// into, and installs again when it wants another one).
    pub fn mark_rolled_back(&self, name: ComponentName, why: impl Into<String>) {
        self.inner.slot(name).state().rolled_back = Some(why.into());
    }

    /// Why the last install of `name` was rolled back, while that is what the component
    /// reports ([`Components::mark_rolled_back`]).
    pub fn rolled_back(&self, name: ComponentName) -> Option<String> {
        self.inner.slot(name).state().rolled_back.clone()
    }

    /// Waits until no install is running.
    pub async fn wait_idle(&self) {
        let mut rx = self.inner.jobs.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Removes what interrupted downloads left beside the components' binaries: their temp
    /// files (a shim killed mid-download leaves one, up to `max_download_bytes`, each time)
    /// untouched for longer than a download may take ([`ComponentsConfig::download_timeout`]),
    /// so that none still being written, by this process or by another shim sharing the
    /// path, is touched. What cannot be read or removed is logged. Returns how many were
    /// removed. Blocking: the binary calls it at start-up, before any install.
    pub fn remove_interrupted_downloads(&self) -> usize {
        let old_enough = self
            .inner
            .config
            .download_timeout
            .saturating_add(Duration::from_secs(60));
        let mut removed = 0;
        for slot in [&self.inner.runner, &self.inner.shim] {
            let (Some(dir), Some(name)) = (slot.path.parent(), slot.path.file_name()) else {
                continue;
            };
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            let Ok(entries) = fs_err::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let file = entry.file_name();
                if !shim_fs::is_temp_of(name, &file) && !is_fetched_of(name, &file) {
                    continue;
                }
                let idle = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .map(|t| t.elapsed().unwrap_or_default());
                if !idle.is_ok_and(|idle| idle > old_enough) {
                    continue;
                }
                match fs_err::remove_file(entry.path()) {
                    Ok(()) => {
                        tracing::info!(file = %entry.path().display(), "removed the temp file of an interrupted download");
                        removed += 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot remove the temp file of an interrupted download");
                    }
                }
            }
        }
        removed
    }

    /// [`Components::remove_interrupted_downloads`] again every `download_timeout` + 60 s until
    /// `stop` is cancelled: a shim killed mid-download and started again by systemd seconds
    /// later finds the temp file too young for its start-up sweep (it may be another shim's
    /// download in progress), so a later sweep removes it once it has aged.
    pub async fn sweep_interrupted_downloads(&self, stop: CancellationToken) {
        let every = self
            .inner
            .config
            .download_timeout
            .saturating_add(Duration::from_secs(60));
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            let this = self.clone();
            if let Err(e) =
                tokio::task::spawn_blocking(move || this.remove_interrupted_downloads()).await
            {
                tracing::warn!(error = %e, "the sweep of interrupted downloads failed");
            }
        }
    }

    /// Cancels running downloads (their temp files are removed, the targets left untouched).
    pub fn cancel(&self) {
        self.inner.cancel.cancel();
    }

    fn begin(&self, name: ComponentName, url: &str) -> Result<JobGuard, ComponentsError> {
        check_url_present(name, url)?;
        {
            let mut st = self.inner.slot(name).state();
            if st.installing {
                return Err(ComponentsError::AlreadyInstalling { name });
            }
            st.installing = true;
            st.rolled_back = None;
        }
        self.inner.jobs.send_modify(|n| *n += 1);
        Ok(JobGuard {
            inner: self.inner.clone(),
            name,
        })
    }

    async fn run_install(&self, name: ComponentName, url: &str) -> Result<(), ComponentsError> {
        let slot = self.inner.slot(name);
        tracing::info!(component = %name, url = %redact_url(url), path = %slot.path.display(),
            "installing component");
        // A shim is fetched beside its path and put there only once it answers `--version`.
        let checked = name == ComponentName::Shim && self.inner.config.rollback_home.is_some();
        let fetched = match checked {
            true => beside(&slot.path),
            false => slot.path.clone(),
        };
        let target = fetched.clone();
        let config = self.inner.config.clone();
        let cancel = self.inner.cancel.clone();
        let owned_url = url.to_owned();
        let result = tokio::task::spawn_blocking(move || {
            download(name, &owned_url, &target, &config, &cancel)
        })
        .await
        .unwrap_or_else(|source| Err(ComponentsError::Join { name, source }));
        let result = match result {
            Ok(()) if checked => self.check_fetched_shim(url, &fetched).await,
            other => other,
        };
        match &result {
            Ok(()) => {
                slot.state().last_error = None;
                tracing::info!(component = %name, path = %slot.path.display(), "component installed");
            }
            Err(e @ (ComponentsError::Refused { .. } | ComponentsError::Unusable { .. })) => {
                // The binary rolled back: reported as after the rollback itself (`error`), not
                // by what stays at the path (the running binary).
                let mut state = slot.state();
                state.last_error = Some(error_chain(e));
                state.rolled_back = Some(error_chain(e));
            }
            Err(e) => slot.state().last_error = Some(error_chain(e)),
        }
        result
    }

    /// The shim fetched beside its path (`fetched`) must answer `--version` before it is put
    /// there: one that does not (another architecture, a truncated or HTML body) would be what
    /// systemd starts at the next restart or reboot, with no pre-flight and no watchdog, and
    /// the server, seeing no version, installs again rather than shutting down. It is
    /// removed, and the binary at the path stays. (It used to be put at the path first and the
    /// running binary copied back over it: a full disk, a crash or a power cut in between left
    /// the broken one there.)
    async fn check_fetched_shim(&self, url: &str, fetched: &Path) -> Result<(), ComponentsError> {
        let name = ComponentName::Shim;
        let path = self.inner.slot(name).path.clone();
        let runner = SystemCommandRunner::default();
        let timeout = self.inner.config.version_timeout;
        let answered = binary_version(&runner, fetched, name.as_str(), timeout).await;
        let (fetched, target) = (fetched.to_owned(), path.clone());
        let checked = answered.is_ok();
        let placed = tokio::task::spawn_blocking(move || match checked {
            true => put_in_place(&fetched, &target),
            false => remove_fetched(&fetched),
        })
        .await
        .unwrap_or_else(|source| Err(ComponentsError::Join { name, source }));
        match answered {
            Ok(_) => placed,
            Err(e) => {
                if let Err(e) = placed {
                    tracing::warn!(error = %error_chain(&e), "cannot remove a shim download that does not run");
                }
                let why = format!("it does not report a version ({})", error_chain(&e));
                Err(ComponentsError::Unusable {
                    name,
                    url: redact_url(url),
                    why,
                })
            }
        }
    }
}

/// Where a checked download waits beside `path`: `.<name>.download-<pid>-<n>` in its
/// directory, a name of this install's own (another shim may share the path). One a kill
/// left, and its temp file, go with [`Components::remove_interrupted_downloads`].
fn beside(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    path.with_file_name(format!(".{name}.download-{}-{n}", std::process::id()))
}

/// Whether `file` is a checked download of the binary `name` ([`beside`]) or its temp file.
fn is_fetched_of(name: &std::ffi::OsStr, file: &std::ffi::OsStr) -> bool {
    let (name, file) = (name.to_string_lossy(), file.to_string_lossy());
    let fetched = format!(".{name}.download-");
    file.starts_with(&fetched)
        || file
            .strip_prefix('.')
            .is_some_and(|f| f.starts_with(&fetched))
}

/// Renames `fetched` over `target` (the same directory), durably. Blocking.
fn put_in_place(fetched: &Path, target: &Path) -> Result<(), ComponentsError> {
    let io = |op, path: &Path| {
        let path = path.to_owned();
        move |e: shim_fs::FsError| ComponentsError::Io {
            op,
            path,
            source: io::Error::other(e),
        }
    };
    let dir = target.parent().unwrap_or(Path::new("."));
    let handle = shim_fs::Dir::open(dir).map_err(io("open directory", dir))?;
    let (from, to) = (file_name(fetched), file_name(target));
    handle
        .rename(from, &handle, to)
        .map_err(io("rename into place", target))?;
    handle.sync().map_err(io("fsync directory", dir))
}

/// Removes a download that is not put in place. Blocking.
fn remove_fetched(fetched: &Path) -> Result<(), ComponentsError> {
    match fs_err::remove_file(fetched) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(ComponentsError::Io {
            op: "remove",
            path: fetched.to_owned(),
            source: e,
        }),
        _ => Ok(()),
    }
}

fn file_name(path: &Path) -> &std::ffi::OsStr {
    path.file_name().unwrap_or_default()
}
