//! The engine's configuration: paths, runner parameters, container defaults, timings, with
//! SPEC's defaults in one place ([`EngineConfig::new`] and the `DEFAULT_*` constants, which the
//! `dstack-shim` binary takes its flags' defaults from).

use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;
use std::time::Duration;

use shim_runtime::LogLimits;
use shim_task::ConfigError;

use crate::gpus::GpuDeviceMode;

/// How the engine runs tasks.
///
/// [`EngineConfig::new`] gives SPEC's defaults (those of upstream's shim,
/// `runner/cmd/shim/main.go`); set the fields that differ. `#[non_exhaustive]`: a field added
/// in a later version breaks no embedder.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The shim home. Task directories live under `<home>/runners/<container name>/`
    /// (upstream's layout; a home of this shim's first release, `<home>/tasks/<id>/`, is
    /// migrated at start-up), and the owner identity is created once and stored in
    /// `<home>/owner-id`. Which containers are this engine's is decided by where their runner
    /// directory mount lies, not by a label (see [`crate::labels`]). One engine per home: the
    /// embedder locks it.
    pub home: PathBuf,
    /// The runner binary on the host, bind-mounted into every container.
    pub runner_binary_path: PathBuf,
    /// The runner's HTTP port in the container.
    pub runner_http_port: u16,
    /// The runner's SSH port in the container.
    pub runner_ssh_port: u16,
    /// The runner's log level, passed as given (`--log-level`).
    pub runner_log_level: String,
    /// The runner's SSH server log level, if any (passed as `--ssh-log-level`).
    pub runner_ssh_log_level: Option<String>,
    /// Names of environment variables whose values (in the shim's own environment) are passed
    /// to every container.
    pub pass_env: Vec<String>,
    /// Run every container privileged.
    pub privileged: bool,
    /// `PJRT_DEVICE` for every container, if set.
    pub pjrt_device: Option<String>,
    /// Where volumes are mounted on the host.
    pub volumes_root: PathBuf,
    /// The longest an image pull may take, moving or not; `None`: no limit.
    pub pull_timeout: Option<Duration>,
    /// The longest an image pull may go without any progress message from the engine before
    /// it fails as stalled; `None`: no limit.
    pub pull_stall_timeout: Option<Duration>,
    /// The period of the full container list, the backstop for lost events. Docker's event
    /// stream is what the engine follows; a list also runs at start-up and on every
    /// (re)connection of the stream.
    pub reconcile_interval: Duration,
    /// Lines of log reported for a container that exited with an error.
    pub exit_log_lines: usize,
    /// How much longer than its stop timeout a terminate may take before it answers with
    /// what is done so far (SPEC §4: within `timeout` + 5 s; the dstack server sends
    /// `timeout: 0` and gives up after 9 s). What is not done by then finishes in the
    /// background.
    pub terminate_slack: Duration,
    /// The bounds of every task container's log (Docker's `json-file` driver with rotation,
    /// see [`LogLimits`]); `None` leaves the daemon's own log configuration (its `log-driver`
    /// and `log-opts`) to apply.
    pub container_log: Option<LogLimits>,
    /// Image collection starts when the file system of the engine's data root is used above
    /// this percentage (kubelet's `imageGCHighThresholdPercent`); 100 turns it off.
    pub image_gc_high_percent: u8,
    /// Image collection removes unused images this shim pulled, least recently used first,
    /// until usage is below this percentage (kept under the high one).
    pub image_gc_low_percent: u8,
    /// How a task's GPUs reach its container: CDI where it can work, else upstream's way
    /// ([`GpuDeviceMode::Auto`], the default), or forced either way.
    pub gpu_device_mode: GpuDeviceMode,
    /// How often the GPUs' health source is probed (`Deps::gpu_health`); zero: never.
    pub gpu_health_interval: Duration,
}

impl EngineConfig {
    /// The runner binary on the host (upstream `consts.RunnerBinaryPath`).
    pub const DEFAULT_RUNNER_BINARY_PATH: &'static str = "/usr/local/bin/dstack-runner";
    /// The runner's HTTP port (upstream `consts.RunnerHTTPPort`).
    pub const DEFAULT_RUNNER_HTTP_PORT: u16 = 10999;
    /// The runner's SSH port (upstream `consts.RunnerSSHPort`).
    pub const DEFAULT_RUNNER_SSH_PORT: u16 = 10022;
    /// The runner's log level (upstream: logrus' `InfoLevel`, as `--runner-log-level`'s
    /// default).
    pub const DEFAULT_RUNNER_LOG_LEVEL: &'static str = "info";
    /// The environment variables passed into containers: the proxies, both cases.
    pub const DEFAULT_PASS_ENV: [&'static str; 6] = [
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    ];
    /// Where volumes are mounted on the host (SPEC §7).
    pub const DEFAULT_VOLUMES_ROOT: &'static str = "/mnt/disks/dstack-volumes";
    /// The longest an image pull may take, moving or not: no limit. A pull ends on a stall
    /// ([`Self::DEFAULT_PULL_STALL_TIMEOUT`]), not on a clock: upstream's 20 minutes (SPEC §2)
    /// failed large images on slow links at 100 % (dstackai/dstack#3040: 11.3 GB at 9 MB/s
    /// needs 21 minutes), and any fixed cap fails a large enough image on a slow enough link
    /// that is still moving (the earlier 2 hours: over ~60 GB at 9 MB/s). An operator may set
    /// one (`--pull-timeout`).
    pub const DEFAULT_PULL_TIMEOUT: Option<Duration> = None;
    /// How long a pull may go without a progress message before it fails as stalled: 10
    /// minutes. Not shorter, because engines go silent in a healthy pull: the containerd
    /// image store reports bytes only per whole MiB, and Docker 26–27 on that store and Podman
    /// report nothing while a layer unpacks, which for a layer of many GB on a slow disk takes
    /// minutes. Half upstream's wall-clock cap: a dead pull fails sooner than it did.
    pub const DEFAULT_PULL_STALL_TIMEOUT: Duration = Duration::from_secs(10 * 60);
    /// The period of the backstop list (SPEC §4: minutes, never every second).
    pub const DEFAULT_RECONCILE_INTERVAL: Duration = Duration::from_secs(5 * 60);
    /// Log lines in the message of a container that exited with an error (SPEC §2).
    pub const DEFAULT_EXIT_LOG_LINES: usize = 5;
    /// A terminate answers within its timeout plus this (SPEC §4: plus 5 s at most).
    pub const DEFAULT_TERMINATE_SLACK: Duration = Duration::from_secs(4);
    /// The size at which a container's log file is rotated: 100 MiB. With
    /// [`Self::DEFAULT_CONTAINER_LOG_MAX_FILES`], a container's log holds at most 300 MiB on
    /// Docker: a week-long job that writes 500 bytes a second keeps all of it, and one that
    /// floods its output cannot fill the disk (the daemon's own default, `json-file` without
    /// options, is unbounded).
    pub const DEFAULT_CONTAINER_LOG_MAX_SIZE: NonZeroU64 = match NonZeroU64::new(100 << 20) {
        Some(n) => n,
        None => NonZeroU64::MIN,
    };
    /// How many log files a container keeps, the current one included: 3.
    pub const DEFAULT_CONTAINER_LOG_MAX_FILES: NonZeroU32 = match NonZeroU32::new(3) {
        Some(n) => n,
        None => NonZeroU32::MIN,
    };

    /// How often GPU health is probed: 30 s (`nvidia-smi -q` takes well under a second;
    /// NVIDIA's device plugin waits on events, DCGM checks every 30 s by default).
    pub const DEFAULT_GPU_HEALTH_INTERVAL: Duration = Duration::from_secs(30);

    /// Collect images above 85 % use of the data root's file system (kubelet's default).
    pub const DEFAULT_IMAGE_GC_HIGH_PERCENT: u8 = 85;
    /// Collect down to 80 % (kubelet's default).
    pub const DEFAULT_IMAGE_GC_LOW_PERCENT: u8 = 80;

    /// A config with SPEC's defaults (the `DEFAULT_*` constants) for everything but the home.
    pub fn new(home: impl Into<PathBuf>) -> Self {
        Self {
            home: home.into(),
            runner_binary_path: PathBuf::from(Self::DEFAULT_RUNNER_BINARY_PATH),
            runner_http_port: Self::DEFAULT_RUNNER_HTTP_PORT,
            runner_ssh_port: Self::DEFAULT_RUNNER_SSH_PORT,
            runner_log_level: Self::DEFAULT_RUNNER_LOG_LEVEL.to_owned(),
            runner_ssh_log_level: None,
            pass_env: default_pass_env(),
            privileged: false,
            pjrt_device: None,
            volumes_root: PathBuf::from(Self::DEFAULT_VOLUMES_ROOT),
            pull_timeout: Self::DEFAULT_PULL_TIMEOUT,
            pull_stall_timeout: Some(Self::DEFAULT_PULL_STALL_TIMEOUT),
            reconcile_interval: Self::DEFAULT_RECONCILE_INTERVAL,
            exit_log_lines: Self::DEFAULT_EXIT_LOG_LINES,
            terminate_slack: Self::DEFAULT_TERMINATE_SLACK,
            container_log: Some(LogLimits::new(
                Self::DEFAULT_CONTAINER_LOG_MAX_SIZE,
                Self::DEFAULT_CONTAINER_LOG_MAX_FILES,
            )),
            image_gc_high_percent: Self::DEFAULT_IMAGE_GC_HIGH_PERCENT,
            image_gc_low_percent: Self::DEFAULT_IMAGE_GC_LOW_PERCENT,
            gpu_device_mode: GpuDeviceMode::Auto,
            gpu_health_interval: Self::DEFAULT_GPU_HEALTH_INTERVAL,
        }
    }
}

impl EngineConfig {
    /// The longest period of the engine's timers ([`Self::reconcile_interval`],
    /// [`Self::gpu_health_interval`]): a day.
    pub const MAX_PERIOD: Duration = Duration::from_secs(86_400);

    /// Checks what [`crate::Engine::open`] cannot run with: a period of the engine's timers
    /// longer than [`Self::MAX_PERIOD`], or a zero [`Self::reconcile_interval`] (tokio's
    /// interval panics on a zero period, and on one that takes an `Instant` past the clock's
    /// range: the reconciler or the GPU health watch would die after the engine opened, with
    /// nothing else to run them). A zero [`Self::gpu_health_interval`] turns the watch off.
    pub fn check(&self) -> Result<(), ConfigError> {
        for (field, period, zero_ok) in [
            ("reconcile_interval", self.reconcile_interval, false),
            ("gpu_health_interval", self.gpu_health_interval, true),
        ] {
            if (period.is_zero() && !zero_ok) || period > Self::MAX_PERIOD {
                return Err(ConfigError {
                    field: field.to_owned(),
                    why: format!(
                        "must be {} and at most {} s, not {period:?}",
                        if zero_ok { "0 (off)" } else { "more than 0" },
                        Self::MAX_PERIOD.as_secs()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// [`EngineConfig::DEFAULT_PASS_ENV`] as owned names.
pub fn default_pass_env() -> Vec<String> {
    EngineConfig::DEFAULT_PASS_ENV
        .iter()
        .map(|v| (*v).to_owned())
        .collect()
}
