//! Command line flags and environment variables, parsed exactly as the upstream shim parses
//! them (upstream `runner/cmd/shim/main.go` with urfave/cli v3), so this binary is a drop-in:
//!
//! - precedence: command line, then the flag's environment variables (in order), then the
//!   default;
//! - booleans take what Go's `strconv.ParseBool` takes (`1 t T TRUE true True 0 f F FALSE
//!   false False`); an empty value in the environment means false;
//! - integers take what `strconv.ParseInt(s, 0, 64)` takes (`0x`, `0o`, `0b` prefixes, a
//!   leading `0` for octal, `_` separators); an empty value in the environment is ignored;
//! - strings are taken as they are: an empty value in the environment overrides the default;
//! - the command line is read as urfave/cli reads it, Go's one-dash flags included
//!   (`-shim-home X`, `-privileged=false`): [`crate::argv`] rewrites it for clap;
//! - positional arguments are ignored (old servers start `dstack-shim docker …`), except a
//!   first `help` / `h`.
//!
//! Upstream's names are read first; where this shim had its own name (`DSTACK_SHIM_PASS_ENV`)
//! it stays an alias. Our additions: `--unix-socket`, `--volumes-root`, `--log-format`,
//! `--reconcile-interval`, `--container-log-max-size` and `--container-log-max-files`,
//! `--pull-stall-timeout` and `--pull-timeout` (Go durations, `0` for none), the DCGM
//! binary paths, and the hidden, testing-only `--fake-gpus`.
//!
//! One job per module: [`args`] (the flags as clap defines them, and the help), [`env`](mod@env)
//! (each flag's environment variables, and the help's paragraph generated from them),
//! [`goparse`] (Go's value parsers, and Docker's sizes), and this module (the resolved [`Config`]: each value from
//! the command line, the environment or the default, and the version string).

mod args;
pub mod env;
pub mod goparse;

use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser as _;
use shim_engine::{EngineConfig, GpuDeviceMode};
use shim_runtime::LogLimits;
use tracing_subscriber::filter::LevelFilter;

pub use args::{Args, command};
use goparse::{docker_size, go_bool, go_duration, go_int, parse_level};

/// The longest `--reconcile-interval`, in seconds: a day.
const MAX_RECONCILE_INTERVAL_S: i64 = 86_400;

/// The dstack release this build speaks for: chosen when it is built
/// (`DSTACK_SHIM_UPSTREAM_VERSION`, set by `cargo xtask dist --upstream-version V`; default
/// `bins/shim/upstream-version`, the release the tests run against). See `build.rs`.
pub const DSTACK_VERSION: &str = env!("DSTACK_SHIM_UPSTREAM_VERSION");

/// The one version string: `--version`, the components list (which the server reads from
/// `--version`) and the healthcheck. `<dstack release>+rust.<crate version>`: the dstack
/// server's check (`_maybe_install_components`) reads it as newer than its own release (a
/// PEP 440 local version sorts after the release), so a release server does not install its
/// Go shim over it, and it compares the installed and running strings as they are, so it
/// does not restart the shim while they are the same build; the API gates parse it as the
/// release, all on. See docs/OPERATIONS.md.
pub const VERSION: &str = concat!(
    env!("DSTACK_SHIM_UPSTREAM_VERSION"),
    "+rust.",
    env!("CARGO_PKG_VERSION")
);

/// The environment variables passed into containers by default (the engine's: the proxies,
/// both cases), as `--pass-env` takes them.
pub fn default_pass_env() -> String {
    EngineConfig::DEFAULT_PASS_ENV.join(",")
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with task ids as fields.
    Json,
}

/// The resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `--version` was asked for.
    pub version: bool,
    /// `help` was given as a positional argument.
    pub help: bool,
    /// The home directory, when set (empty: `~/.dstack`).
    pub shim_home: String,
    /// The shim binary, when set.
    pub shim_binary_path: Option<String>,
    /// API port.
    pub shim_http_port: u16,
    /// The shim's log level.
    pub shim_log_level: LevelFilter,
    /// Runner download URL (empty: none).
    pub runner_download_url: String,
    /// DCGM settings.
    pub dcgm: shim_dcgm::DcgmConfig,
    /// Service mode: write host_info.json.
    pub service: bool,
    /// An extra Unix socket for the API.
    pub unix_socket: Option<PathBuf>,
    /// Log format.
    pub log_format: LogFormat,
    /// What the engine is given: the runner's binary, ports and levels, what containers get
    /// (`--pass-env`, `--privileged`, `--pjrt-device`, the log bounds), where volumes are
    /// mounted, the backstop period, the pull timeouts and image collection. Its `home` is set
    /// when the engine opens (the resolved `--shim-home`, [`Config::home`]).
    pub engine: EngineConfig,
    /// Testing only: a fake GPU host of N GPUs.
    pub fake_gpus: Option<u32>,
    /// How often the GPUs' health is probed on an NVIDIA host (`None`: never; every GPU is
    /// taken as healthy).
    pub gpu_health_interval: Option<Duration>,
    /// Which XIDs make a GPU unhealthy (NVIDIA's device plugin's rule, plus the operator's
    /// `--disable-gpu-healthchecks`).
    pub xid_policy: shim_resources::gpu::XidPolicy,
}

/// Where a raw value came from, for messages.
enum Source {
    Flag,
    Env(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Flag => f.write_str("the command line"),
            Self::Env(name) => write!(f, "environment variable {name:?}"),
        }
    }
}

/// Looks up a flag's value: the command line, else its environment variables in order.
struct Lookup<'a> {
    env: &'a dyn Fn(&str) -> Option<String>,
}

impl Lookup<'_> {
    fn raw(&self, flag: &str, cli: &Option<String>) -> Option<(String, Source)> {
        if let Some(v) = cli {
            return Some((v.clone(), Source::Flag));
        }
        env::names(flag)
            .iter()
            .find_map(|name| (self.env)(name).map(|v| (v, Source::Env(name))))
    }

    /// A string flag: an empty environment value overrides the default.
    fn string(&self, flag: &str, cli: &Option<String>, default: &str) -> String {
        self.raw(flag, cli)
            .map_or_else(|| default.to_owned(), |(v, _)| v)
    }

    /// An integer flag: an empty environment value is ignored.
    fn int(&self, flag: &str, cli: &Option<String>, default: i64) -> anyhow::Result<i64> {
        match self.raw(flag, cli) {
            Some((v, Source::Env(_))) if v.is_empty() => Ok(default),
            Some((v, source)) => go_int(&v).with_context(|| {
                format!("could not parse {v:?} as int value from {source} for flag {flag}")
            }),
            None => Ok(default),
        }
    }

    fn port(&self, flag: &str, cli: &Option<String>, default: u16) -> anyhow::Result<u16> {
        let n = self.int(flag, cli, i64::from(default))?;
        u16::try_from(n).with_context(|| format!("{flag}: {n} is not a port number"))
    }

    /// The container log bounds: `--container-log-max-size` (a Docker size, or `daemon` for
    /// none; an empty environment value is ignored) and `--container-log-max-files` (an
    /// integer, at least 1; checked with `daemon` too).
    fn container_log(
        &self,
        max_size: &Option<String>,
        max_files: &Option<String>,
    ) -> anyhow::Result<Option<LogLimits>> {
        const SIZE: &str = "container-log-max-size";
        const FILES: &str = "container-log-max-files";
        let default_files = i64::from(EngineConfig::DEFAULT_CONTAINER_LOG_MAX_FILES.get());
        let files = self.int(FILES, max_files, default_files)?;
        let files = u32::try_from(files)
            .ok()
            .and_then(NonZeroU32::new)
            .with_context(|| {
                format!(
                    "{FILES} must be a number of files from 1 to {}, not {files}",
                    u32::MAX
                )
            })?;
        let size = match self.raw(SIZE, max_size) {
            Some((v, Source::Env(_))) if v.is_empty() => None,
            other => other,
        };
        let size = match size {
            None => EngineConfig::DEFAULT_CONTAINER_LOG_MAX_SIZE,
            Some((v, _)) if v == "daemon" => return Ok(None),
            Some((v, source)) => docker_size(&v).and_then(NonZeroU64::new).with_context(|| {
                format!(
                    "invalid {SIZE} {v:?} from {source}: give a size of 1 byte or more, a \
                         number with an optional unit k, m or g (powers of 1024, as Docker's \
                         max-size: 100m), or \"daemon\" to leave the daemon's log configuration"
                )
            })?,
        };
        Ok(Some(LogLimits::new(size, files)))
    }

    /// A duration flag, as Go's `time.ParseDuration` reads it; `0` (any zero): `None`, no
    /// limit. An empty environment value is ignored.
    fn duration(
        &self,
        flag: &str,
        cli: &Option<String>,
        default: Option<Duration>,
    ) -> anyhow::Result<Option<Duration>> {
        let value = match self.raw(flag, cli) {
            Some((v, Source::Env(_))) if v.is_empty() => default.unwrap_or_default(),
            Some((v, source)) => go_duration(&v).with_context(|| {
                format!(
                    "invalid {flag} {v:?} from {source}: give a Go duration such as 90s, 10m or \
                     1h30m (a number needs a unit: ns, us, ms, s, m, h), or 0 for no limit"
                )
            })?,
            None => default.unwrap_or_default(),
        };
        Ok(Some(value).filter(|d| !d.is_zero()))
    }

    /// Image collection's thresholds `(high, low)`: integers 0 to 100, low under high (as
    /// kubelet checks its `--image-gc-*-threshold`), high 100 for off.
    fn image_gc(&self, high: &Option<String>, low: &Option<String>) -> anyhow::Result<(u8, u8)> {
        let percent = |flag: &str, cli: &Option<String>, default: u8| -> anyhow::Result<u8> {
            let n = self.int(flag, cli, i64::from(default))?;
            u8::try_from(n)
                .ok()
                .filter(|p| *p <= 100)
                .with_context(|| format!("{flag} must be a percentage from 0 to 100, not {n}"))
        };
        let high = percent(
            "image-gc-high-percent",
            high,
            EngineConfig::DEFAULT_IMAGE_GC_HIGH_PERCENT,
        )?;
        let low = percent(
            "image-gc-low-percent",
            low,
            EngineConfig::DEFAULT_IMAGE_GC_LOW_PERCENT,
        )?;
        if low >= high {
            bail!(
                "image-gc-low-percent ({low}) must be less than image-gc-high-percent ({high}): \
                 collection frees down to the low mark once usage passes the high one"
            );
        }
        Ok((high, low))
    }

    /// A boolean flag: an empty environment value is false.
    fn bool(&self, flag: &str, cli: &Option<String>) -> anyhow::Result<bool> {
        match self.raw(flag, cli) {
            Some((v, Source::Env(_))) if v.is_empty() => Ok(false),
            Some((v, source)) => go_bool(&v).with_context(|| {
                format!(
                    "could not parse {v:?} as bool value from {source} for flag {flag}: parse error"
                )
            }),
            None => Ok(false),
        }
    }
}

impl Config {
    /// Parses the process's command line (Go's flag syntax too, see [`crate::argv`]) and
    /// environment.
    pub fn from_process() -> anyhow::Result<Self> {
        let argv = crate::argv::normalise(std::env::args_os(), &command())?;
        let args = Args::parse_from(argv);
        Self::resolve(&args, &|name| std::env::var(name).ok())
    }

    /// Resolves the command line against an environment (`env(name)` gives a variable's value
    /// if it is set, empty or not).
    pub fn resolve(args: &Args, env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let l = Lookup { env };
        if args.version || args.help {
            // Like upstream, --version and help win over bad values elsewhere.
            return Ok(Self::for_version(args.version, args.help));
        }
        // Upstream checks the runner's level first, then the shim's.
        let runner_log_level = l.string(
            "runner-log-level",
            &args.runner_log_level,
            EngineConfig::DEFAULT_RUNNER_LOG_LEVEL,
        );
        parse_level(&runner_log_level)?;
        let shim_log_level =
            parse_level(&l.string("shim-log-level", &args.shim_log_level, "info"))?;
        let pass_env = l
            .string("pass-env", &args.pass_env, &default_pass_env())
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let log_format = match l.string("log-format", &args.log_format, "text").as_str() {
            "text" | "" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => bail!("invalid log format {other:?}: use text or json"),
        };
        let default_interval =
            i64::try_from(EngineConfig::DEFAULT_RECONCILE_INTERVAL.as_secs()).unwrap_or(i64::MAX);
        let interval = l.int(
            "reconcile-interval",
            &args.reconcile_interval,
            default_interval,
        )?;
        // At most a day: tokio's interval adds its period to an `Instant`, which panics past
        // the clock's range (the reconciler's task would die with the API still answering).
        if !(1..=MAX_RECONCILE_INTERVAL_S).contains(&interval) {
            bail!(
                "reconcile-interval must be from 1 to {MAX_RECONCILE_INTERVAL_S} seconds, not {interval}"
            );
        }
        let container_log =
            l.container_log(&args.container_log_max_size, &args.container_log_max_files)?;
        let pull_stall_timeout = l.duration(
            "pull-stall-timeout",
            &args.pull_stall_timeout,
            Some(EngineConfig::DEFAULT_PULL_STALL_TIMEOUT),
        )?;
        let pull_timeout = l.duration(
            "pull-timeout",
            &args.pull_timeout,
            EngineConfig::DEFAULT_PULL_TIMEOUT,
        )?;
        let image_gc_percent =
            l.image_gc(&args.image_gc_high_percent, &args.image_gc_low_percent)?;
        let gpu_health_interval = l.duration(
            "gpu-health-interval",
            &args.gpu_health_interval,
            Some(EngineConfig::DEFAULT_GPU_HEALTH_INTERVAL),
        )?;
        // At most a day, for the reconcile interval's reason.
        if gpu_health_interval.is_some_and(|every| every > EngineConfig::MAX_PERIOD) {
            bail!("gpu-health-interval must be at most 24h (0 turns the probe off)");
        }
        let xid_policy = shim_resources::gpu::XidPolicy::parse_skip_list(&l.string(
            "disable-gpu-healthchecks",
            &args.disable_gpu_healthchecks,
            "",
        ));
        let gpu_device_mode: GpuDeviceMode = l
            .string("gpu-device-mode", &args.gpu_device_mode, "auto")
            .parse()
            .map_err(|e: String| anyhow::anyhow!("{e}"))?;
        let path = |flag: &str, cli: &Option<String>| {
            Some(l.string(flag, cli, ""))
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
        };
        let dcgm = shim_dcgm::DcgmConfig {
            exporter_http_port: l.port(
                "dcgm-exporter-http-port",
                &args.dcgm_exporter_http_port,
                shim_dcgm::DEFAULT_EXPORTER_HTTP_PORT,
            )?,
            exporter_interval: Duration::from_millis(
                u64::try_from(l.int(
                    "dcgm-exporter-interval",
                    &args.dcgm_exporter_interval,
                    i64::try_from(shim_dcgm::DEFAULT_EXPORTER_INTERVAL_MS).unwrap_or(5000),
                )?)
                .context("dcgm-exporter-interval must not be negative")?,
            ),
            address: Some(l.string("dcgm-address", &args.dcgm_address, ""))
                .filter(|a| !a.is_empty()),
            exporter_path: path("dcgm-exporter-path", &args.dcgm_exporter_path),
            dcgmi_path: path("dcgmi-path", &args.dcgmi_path),
            hostengine_path: path("nv-hostengine-path", &args.nv_hostengine_path),
            ..shim_dcgm::DcgmConfig::default()
        };
        // Read in the flags' order (which error a start with several bad values reports).
        let shim_home = l.string("shim-home", &args.shim_home, "");
        let shim_binary_path = l
            .raw("shim-binary-path", &args.shim_binary_path)
            .map(|(v, _)| v);
        let shim_http_port = l.port("shim-http-port", &args.shim_http_port, 10998)?;
        let runner_download_url = l.string("runner-download-url", &args.runner_download_url, "");
        let mut engine = EngineConfig::new(PathBuf::new());
        engine.runner_binary_path = PathBuf::from(l.string(
            "runner-binary-path",
            &args.runner_binary_path,
            EngineConfig::DEFAULT_RUNNER_BINARY_PATH,
        ));
        engine.runner_http_port = l.port(
            "runner-http-port",
            &args.runner_http_port,
            EngineConfig::DEFAULT_RUNNER_HTTP_PORT,
        )?;
        engine.runner_ssh_port = l.port(
            "runner-ssh-port",
            &args.runner_ssh_port,
            EngineConfig::DEFAULT_RUNNER_SSH_PORT,
        )?;
        engine.runner_ssh_log_level =
            Some(l.string("runner-ssh-log-level", &args.runner_ssh_log_level, ""))
                .filter(|v| !v.is_empty());
        engine.runner_log_level = runner_log_level;
        engine.pass_env = pass_env;
        engine.privileged = l.bool("privileged", &args.privileged)?;
        engine.pjrt_device =
            Some(l.string("pjrt-device", &args.pjrt_device, "")).filter(|v| !v.is_empty());
        let service = l.bool("service", &args.service)?;
        let unix_socket = path("unix-socket", &args.unix_socket);
        engine.volumes_root = PathBuf::from(l.string(
            "volumes-root",
            &args.volumes_root,
            EngineConfig::DEFAULT_VOLUMES_ROOT,
        ));
        // A relative (or empty) root would put mount points under the shim's working
        // directory (`/`: a volume named `var` over `/var`).
        if !engine.volumes_root.is_absolute() {
            bail!(
                "volumes-root must be an absolute path, not {:?}",
                engine.volumes_root
            );
        }
        engine.reconcile_interval = Duration::from_secs(interval.unsigned_abs());
        engine.container_log = container_log;
        engine.pull_stall_timeout = pull_stall_timeout;
        engine.pull_timeout = pull_timeout;
        (engine.image_gc_high_percent, engine.image_gc_low_percent) = image_gc_percent;
        engine.gpu_device_mode = gpu_device_mode;
        Ok(Self {
            version: false,
            help: false,
            shim_home,
            shim_binary_path,
            shim_http_port,
            shim_log_level,
            runner_download_url,
            dcgm,
            service,
            unix_socket,
            log_format,
            engine,
            fake_gpus: match &args.fake_gpus {
                Some(n) => Some(n.parse().context("--fake-gpus takes a count")?),
                None => None,
            },
            gpu_health_interval,
            xid_policy,
        })
    }

    fn for_version(version: bool, help: bool) -> Self {
        Self {
            version,
            help,
            shim_home: String::new(),
            shim_binary_path: None,
            shim_http_port: 10998,
            shim_log_level: LevelFilter::INFO,
            runner_download_url: String::new(),
            dcgm: shim_dcgm::DcgmConfig::default(),
            service: false,
            unix_socket: None,
            log_format: LogFormat::Text,
            engine: EngineConfig::new(PathBuf::new()),
            fake_gpus: None,
            gpu_health_interval: None,
            xid_policy: shim_resources::gpu::XidPolicy::default(),
        }
    }

    /// The home directory: `--shim-home`, or `~/.dstack` (also when set empty, as upstream).
    pub fn home(&self) -> anyhow::Result<PathBuf> {
        if !self.shim_home.is_empty() {
            return Ok(PathBuf::from(&self.shim_home));
        }
        let user_home = std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(PathBuf::from)
            .or_else(std::env::home_dir)
            .context("cannot find the user's home directory; pass --shim-home")?;
        Ok(user_home.join(".dstack"))
    }

    /// The shim binary: `--shim-binary-path`, or the running executable.
    pub fn shim_binary(&self) -> anyhow::Result<PathBuf> {
        match &self.shim_binary_path {
            Some(p) if p.is_empty() => bail!("shim-binary-path is empty"),
            Some(p) => Ok(PathBuf::from(p)),
            None => std::env::current_exe().context("cannot find the running executable"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use clap::Parser as _;

    use super::*;

    fn resolve(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Config> {
        let argv = crate::argv::normalise(
            std::iter::once("dstack-shim")
                .chain(args.iter().copied())
                .map(std::ffi::OsString::from),
            &command(),
        )?;
        let args = Args::try_parse_from(argv)?;
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::resolve(&args, &|name| env.get(name).cloned())
    }

    fn ok(args: &[&str], env: &[(&str, &str)]) -> Config {
        resolve(args, env).unwrap()
    }

    /// Upstream's flags, environment variables and defaults (upstream `runner/cmd/shim/main.go`,
    /// `mainInner`; `runner/internal/common/consts/consts.go`), read back through this
    /// binary's parsing.
    #[test]
    fn upstream_names_and_defaults() {
        let table: &[(&str, &str, &str)] = &[
            // (flag, env var, default as resolved)
            ("shim-home", "DSTACK_SHIM_HOME", ""),
            ("shim-http-port", "DSTACK_SHIM_HTTP_PORT", "10998"),
            ("shim-log-level", "DSTACK_SHIM_LOG_LEVEL", "info"),
            ("runner-download-url", "DSTACK_RUNNER_DOWNLOAD_URL", ""),
            (
                "runner-binary-path",
                "DSTACK_RUNNER_BINARY_PATH",
                "/usr/local/bin/dstack-runner",
            ),
            ("runner-http-port", "DSTACK_RUNNER_HTTP_PORT", "10999"),
            ("runner-ssh-port", "DSTACK_RUNNER_SSH_PORT", "10022"),
            ("runner-ssh-log-level", "DSTACK_RUNNER_SSH_LOG_LEVEL", ""),
            ("runner-log-level", "DSTACK_RUNNER_LOG_LEVEL", "info"),
            (
                "dcgm-exporter-http-port",
                "DSTACK_DCGM_EXPORTER_HTTP_PORT",
                "10997",
            ),
            (
                "dcgm-exporter-interval",
                "DSTACK_DCGM_EXPORTER_INTERVAL",
                "5000",
            ),
            ("dcgm-address", "DSTACK_DCGM_ADDRESS", ""),
            (
                "pass-env",
                "DSTACK_DOCKER_PASS_ENV",
                "http_proxy,https_proxy,no_proxy,HTTP_PROXY,HTTPS_PROXY,NO_PROXY",
            ),
            ("privileged", "DSTACK_DOCKER_PRIVILEGED", "false"),
            ("pjrt-device", "PJRT_DEVICE", ""),
            ("service", "DSTACK_SERVICE_MODE", "false"),
        ];
        let show = |c: &Config, flag: &str| -> String {
            match flag {
                "shim-home" => c.shim_home.clone(),
                "shim-http-port" => c.shim_http_port.to_string(),
                "shim-log-level" => c.shim_log_level.to_string().to_lowercase(),
                "runner-download-url" => c.runner_download_url.clone(),
                "runner-binary-path" => c.engine.runner_binary_path.display().to_string(),
                "runner-http-port" => c.engine.runner_http_port.to_string(),
                "runner-ssh-port" => c.engine.runner_ssh_port.to_string(),
                "runner-ssh-log-level" => c.engine.runner_ssh_log_level.clone().unwrap_or_default(),
                "runner-log-level" => c.engine.runner_log_level.clone(),
                "dcgm-exporter-http-port" => c.dcgm.exporter_http_port.to_string(),
                "dcgm-exporter-interval" => c.dcgm.exporter_interval.as_millis().to_string(),
                "dcgm-address" => c.dcgm.address.clone().unwrap_or_default(),
                "pass-env" => c.engine.pass_env.join(","),
                "privileged" => c.engine.privileged.to_string(),
                "pjrt-device" => c.engine.pjrt_device.clone().unwrap_or_default(),
                "service" => c.service.to_string(),
                other => panic!("{other}"),
            }
        };
        let defaults = ok(&[], &[]);
        for (flag, env, default) in table {
            assert_eq!(show(&defaults, flag), *default, "default of --{flag}");
            // Each flag reads its upstream environment variable.
            let names = env::names(flag);
            assert_eq!(names[0], *env, "--{flag} reads {env} first");
        }
        // Values through the environment, as an SSH fleet's shim.env sets them (upstream
        // server `ssh_fleets/provisioning.py`).
        let c = ok(
            &[],
            &[
                ("DSTACK_SHIM_HOME", "/root/.dstack"),
                ("DSTACK_SHIM_HTTP_PORT", "10998"),
                ("DSTACK_SHIM_LOG_LEVEL", "5"),
                ("DSTACK_RUNNER_DOWNLOAD_URL", "https://x/dstack-runner"),
                ("DSTACK_RUNNER_BINARY_PATH", "/usr/local/bin/dstack-runner"),
                ("DSTACK_RUNNER_HTTP_PORT", "10999"),
                ("DSTACK_RUNNER_SSH_PORT", "10022"),
                ("DSTACK_RUNNER_LOG_LEVEL", "5"),
                ("DSTACK_SERVICE_MODE", "1"),
                ("DSTACK_DOCKER_PRIVILEGED", "T"),
                ("DSTACK_DOCKER_PASS_ENV", "A,B"),
                ("DSTACK_DCGM_EXPORTER_HTTP_PORT", "0x2af5"),
                ("PJRT_DEVICE", "TPU"),
            ],
        );
        assert!(c.service && c.engine.privileged);
        assert_eq!(c.shim_log_level, LevelFilter::DEBUG);
        assert_eq!(
            c.engine.runner_log_level, "5",
            "passed to the runner as given"
        );
        assert_eq!(c.engine.pass_env, ["A", "B"]);
        assert_eq!(c.dcgm.exporter_http_port, 0x2af5);
        assert_eq!(c.engine.pjrt_device.as_deref(), Some("TPU"));
        assert_eq!(c.home().unwrap(), PathBuf::from("/root/.dstack"));
        // Our old name stays an alias.
        assert_eq!(
            ok(&[], &[("DSTACK_SHIM_PASS_ENV", "C")]).engine.pass_env,
            ["C"]
        );
    }

    /// urfave/cli v3's value rules (`flag_bool.go`, `flag_int.go`, `flag_impl.go` PostParse).
    #[test]
    fn values_are_parsed_as_upstream_parses_them() {
        for v in ["1", "t", "T", "TRUE", "true", "True"] {
            assert!(ok(&[], &[("DSTACK_SERVICE_MODE", v)]).service, "{v}");
        }
        for v in ["0", "f", "F", "FALSE", "false", "False", ""] {
            assert!(!ok(&[], &[("DSTACK_SERVICE_MODE", v)]).service, "{v:?}");
        }
        let err = resolve(&[], &[("DSTACK_SERVICE_MODE", "yes")]).unwrap_err();
        assert!(err.to_string().contains("DSTACK_SERVICE_MODE"), "{err}");
        // The flag on the command line, with or without a value.
        assert!(ok(&["--privileged"], &[]).engine.privileged);
        assert!(
            !ok(
                &["--privileged=false"],
                &[("DSTACK_DOCKER_PRIVILEGED", "1")]
            )
            .engine
            .privileged
        );
        // Integers: base 0, sign, an empty environment value ignored.
        for (v, port) in [
            ("010", 8),
            ("0x10", 16),
            ("0b11", 3),
            ("0o17", 15),
            ("1_0", 0),
        ] {
            let r = resolve(&[], &[("DSTACK_RUNNER_HTTP_PORT", v)]);
            if v == "1_0" {
                assert!(r.is_err(), "underscores need a prefix");
            } else {
                assert_eq!(r.unwrap().engine.runner_http_port, port, "{v}");
            }
        }
        assert_eq!(go_int("-12"), Some(-12));
        assert_eq!(go_int("0x_1f"), Some(31));
        assert_eq!(go_int(" 1"), None);
        assert_eq!(
            ok(&[], &[("DSTACK_RUNNER_HTTP_PORT", "")])
                .engine
                .runner_http_port,
            10999
        );
        assert!(resolve(&[], &[("DSTACK_SHIM_HTTP_PORT", "abc")]).is_err());
        // Strings: an empty value overrides the default.
        assert!(
            ok(&[], &[("DSTACK_DOCKER_PASS_ENV", "")])
                .engine
                .pass_env
                .is_empty()
        );
        assert!(resolve(&[], &[("DSTACK_SHIM_LOG_LEVEL", "")]).is_err());
        // A relative or empty volumes root would put mount points under `/` (a volume named
        // `var` over `/var`).
        for root in ["", "vols"] {
            let e = resolve(&[], &[("DSTACK_SHIM_VOLUMES_ROOT", root)]).unwrap_err();
            assert!(e.to_string().contains("absolute"), "{e}");
        }
        for interval in ["0", "-1", "86401", "9223372036854775807"] {
            let e = resolve(&["--reconcile-interval", interval], &[]).unwrap_err();
            assert!(e.to_string().contains("reconcile-interval"), "{e}");
        }
        let e = resolve(&["--gpu-health-interval", "24h1s"], &[]).unwrap_err();
        assert!(e.to_string().contains("gpu-health-interval"), "{e}");
        let day = ok(&["--gpu-health-interval", "24h"], &[]).gpu_health_interval;
        assert_eq!(day, Some(EngineConfig::MAX_PERIOD));
        let day = ok(&["--reconcile-interval", "86400"], &[]).engine;
        assert_eq!(day.reconcile_interval, Duration::from_secs(86_400));
        assert_eq!(ok(&[], &[("DSTACK_SHIM_HOME", "")]).shim_home, "");
        // The command line wins over the environment.
        assert_eq!(
            ok(
                &["--shim-http-port", "1234"],
                &[("DSTACK_SHIM_HTTP_PORT", "99")]
            )
            .shim_http_port,
            1234
        );
    }

    /// Issue 28 part 3: image collection's thresholds, kubelet's defaults (85 / 80) and its
    /// check (low under high); 100 turns collection off.
    #[test]
    fn image_gc_thresholds() {
        let gc = |args: &[&str], env: &[(&str, &str)]| {
            let c = ok(args, env).engine;
            (c.image_gc_high_percent, c.image_gc_low_percent)
        };
        assert_eq!(gc(&[], &[]), (85, 80), "kubelet's defaults");
        assert_eq!(
            gc(
                &["--image-gc-high-percent", "90", "-image-gc-low-percent=50"],
                &[]
            ),
            (90, 50)
        );
        assert_eq!(
            gc(
                &[],
                &[
                    ("DSTACK_SHIM_IMAGE_GC_HIGH_PERCENT", "100"),
                    ("DSTACK_SHIM_IMAGE_GC_LOW_PERCENT", "")
                ]
            ),
            (100, 80),
            "100 is off; an empty variable keeps the default"
        );
        for (high, low, says) in [
            (
                "101",
                "80",
                "image-gc-high-percent must be a percentage from 0 to 100, not 101",
            ),
            (
                "85",
                "-1",
                "image-gc-low-percent must be a percentage from 0 to 100, not -1",
            ),
            (
                "80",
                "80",
                "image-gc-low-percent (80) must be less than image-gc-high-percent (80)",
            ),
            (
                "50",
                "60",
                "image-gc-low-percent (60) must be less than image-gc-high-percent (50)",
            ),
        ] {
            let err = resolve(
                &[
                    &format!("--image-gc-high-percent={high}"),
                    &format!("--image-gc-low-percent={low}"),
                ],
                &[],
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(says), "{high}/{low}: {err}");
        }
        let err = resolve(&[], &[("DSTACK_SHIM_IMAGE_GC_HIGH_PERCENT", "most")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("DSTACK_SHIM_IMAGE_GC_HIGH_PERCENT")
                && err.contains("image-gc-high-percent"),
            "{err}"
        );
    }

    /// Issue 28 part 1 and issue 39 part 5: pulls end on a stall (default 10m), not on a
    /// clock (no wall-clock limit unless the operator sets one); both Go durations, 0 for
    /// none.
    #[test]
    fn pull_timeouts() {
        let timeouts = |args: &[&str], env: &[(&str, &str)]| {
            let c = ok(args, env);
            (c.engine.pull_stall_timeout, c.engine.pull_timeout)
        };
        let mins = |m: u64| Some(Duration::from_secs(m * 60));
        assert_eq!(timeouts(&[], &[]), (mins(10), None), "the defaults");
        assert_eq!(
            timeouts(&["--pull-stall-timeout", "5m", "--pull-timeout=1h30m"], &[]),
            (mins(5), mins(90))
        );
        assert_eq!(
            timeouts(
                &[],
                &[
                    ("DSTACK_SHIM_PULL_STALL_TIMEOUT", "90s"),
                    ("DSTACK_SHIM_PULL_TIMEOUT", "0"),
                ]
            ),
            (Some(Duration::from_secs(90)), None),
            "0: no wall clock, as by default"
        );
        assert_eq!(
            timeouts(&["-pull-stall-timeout=0s", "-pull-timeout", "4h"], &[]),
            (None, mins(240)),
            "Go's one-dash flags; any zero turns the stall watchdog off"
        );
        // An empty environment value is ignored; the command line wins.
        assert_eq!(
            timeouts(
                &["--pull-timeout", "3h"],
                &[
                    ("DSTACK_SHIM_PULL_STALL_TIMEOUT", ""),
                    ("DSTACK_SHIM_PULL_TIMEOUT", "1h")
                ]
            ),
            (mins(10), mins(180))
        );
        for bad in ["300", "5 m", "-5m", "5d", "soon"] {
            let err = resolve(&[&format!("--pull-stall-timeout={bad}")], &[])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!(
                    "invalid pull-stall-timeout {bad:?} from the command line"
                )) && err.contains("Go duration"),
                "{bad:?}: {err}"
            );
        }
        let err = resolve(&[], &[("DSTACK_SHIM_PULL_TIMEOUT", "2 hours")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid pull-timeout \"2 hours\"")
                && err.contains("DSTACK_SHIM_PULL_TIMEOUT"),
            "{err}"
        );
    }

    /// Issue 36: how GPUs reach containers, `auto` by default, forced by flag or environment;
    /// anything else stops the shim at start-up, naming the choices.
    #[test]
    fn gpu_device_modes() {
        let mode = |args: &[&str], env: &[(&str, &str)]| ok(args, env).engine.gpu_device_mode;
        assert_eq!(mode(&[], &[]), GpuDeviceMode::Auto);
        assert_eq!(mode(&["--gpu-device-mode", "cdi"], &[]), GpuDeviceMode::Cdi);
        assert_eq!(
            mode(&[], &[("DSTACK_SHIM_GPU_DEVICE_MODE", "legacy")]),
            GpuDeviceMode::Legacy
        );
        assert_eq!(
            mode(
                &["-gpu-device-mode=auto"],
                &[("DSTACK_SHIM_GPU_DEVICE_MODE", "cdi")]
            ),
            GpuDeviceMode::Auto,
            "the command line wins"
        );
        let err = resolve(&["--gpu-device-mode", "nvidia"], &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid GPU device mode \"nvidia\": use auto, cdi or legacy"),
            "{err}"
        );
    }

    /// Issue 28: every container's log is bounded. `--container-log-max-size` takes Docker's
    /// sizes (units k, m, g: powers of 1024) or `daemon` (no bounds: the daemon's own log
    /// configuration); `--container-log-max-files` an integer from 1. Defaults 100m × 3. A bad
    /// value stops the start, naming the flag or variable and what it takes.
    #[test]
    fn container_log_limits() {
        let limits = |args: &[&str], env: &[(&str, &str)]| {
            ok(args, env)
                .engine
                .container_log
                .map(|l| (l.max_size.get(), l.max_files.get()))
        };
        assert_eq!(limits(&[], &[]), Some((100 << 20, 3)), "the defaults");
        assert_eq!(
            limits(
                &[
                    "--container-log-max-size",
                    "1m",
                    "--container-log-max-files=2"
                ],
                &[]
            ),
            Some((1 << 20, 2))
        );
        assert_eq!(
            limits(
                &[],
                &[
                    ("DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE", "1.5g"),
                    ("DSTACK_SHIM_CONTAINER_LOG_MAX_FILES", "0x10"),
                ]
            ),
            Some((3 << 29, 16))
        );
        for (size, bytes) in [
            ("1048576", 1 << 20),
            ("512k", 512 << 10),
            ("512KiB", 512 << 10),
            ("100MB", 100 << 20),
            ("2 g", 2 << 30),
            ("1", 1),
        ] {
            assert_eq!(
                limits(&["--container-log-max-size", size], &[]),
                Some((bytes, 3)),
                "{size}"
            );
        }
        // An empty environment value is ignored, as an integer's; the command line wins.
        assert_eq!(
            limits(&[], &[("DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE", "")]),
            Some((100 << 20, 3))
        );
        assert_eq!(
            limits(
                &["--container-log-max-size", "20m"],
                &[("DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE", "daemon")]
            ),
            Some((20 << 20, 3))
        );
        // `daemon`: no bounds, from the command line or the environment.
        assert_eq!(limits(&["--container-log-max-size", "daemon"], &[]), None);
        assert_eq!(
            limits(&[], &[("DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE", "daemon")]),
            None
        );
        for bad in [
            "0", "0k", "-1m", "100x", "100 mb!", "1t", "Daemon", "m", "1e6",
        ] {
            let err = resolve(&[&format!("--container-log-max-size={bad}")], &[])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("invalid container-log-max-size {bad:?}"))
                    && err.contains("the command line")
                    && err.contains("\"daemon\""),
                "{bad:?}: {err}"
            );
        }
        let err = resolve(&[], &[("DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE", "lots")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE"), "{err}");
        for bad in ["0", "-1", "4294967296"] {
            let err = resolve(&[&format!("--container-log-max-files={bad}")], &[])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("container-log-max-files must be a number of files from 1"),
                "{bad}: {err}"
            );
        }
        let err = resolve(&[], &[("DSTACK_SHIM_CONTAINER_LOG_MAX_FILES", "three")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("DSTACK_SHIM_CONTAINER_LOG_MAX_FILES")
                && err.contains("container-log-max-files"),
            "{err}"
        );
        // The count is checked with `daemon` too: a typo does not hide behind it.
        assert!(
            resolve(
                &[
                    "--container-log-max-size",
                    "daemon",
                    "--container-log-max-files",
                    "0"
                ],
                &[]
            )
            .is_err()
        );
    }

    #[test]
    fn positional_arguments_are_ignored_but_help() {
        assert!(ok(&["docker", "--privileged"], &[]).engine.privileged);
        assert!(ok(&["podman"], &[]).engine.pass_env.len() == 6);
        assert!(ok(&["help"], &[("DSTACK_SERVICE_MODE", "bad")]).help);
        assert!(ok(&["-h"], &[("DSTACK_SERVICE_MODE", "bad")]).help);
        assert!(
            !ok(&["docker", "help"], &[]).help,
            "only a first positional is help"
        );
        assert!(ok(&["-v"], &[("DSTACK_SERVICE_MODE", "bad")]).version);
        // An unknown flag is an error, as upstream.
        assert!(resolve(&["docker", "--ssh-key", "x"], &[]).is_err());
    }

    /// Go's flag syntax, for every flag (upstream `runner/cmd/shim/main.go` parses its
    /// command line with urfave/cli v3, which takes one dash or two, `=` or a space).
    #[test]
    fn every_flag_takes_gos_syntax() {
        let values: &[(&str, &str)] = &[
            ("shim-home", "/h"),
            ("shim-binary-path", "/b"),
            ("shim-http-port", "1234"),
            ("shim-log-level", "debug"),
            ("runner-download-url", "http://x/r"),
            ("runner-binary-path", "/r"),
            ("runner-http-port", "2345"),
            ("runner-ssh-port", "3456"),
            ("runner-ssh-log-level", "debug"),
            ("runner-log-level", "trace"),
            ("dcgm-exporter-http-port", "4567"),
            ("dcgm-exporter-interval", "1000"),
            ("dcgm-address", "10.0.0.1"),
            ("pass-env", "A,B"),
            ("pjrt-device", "TPU"),
            ("unix-socket", "/s"),
            ("volumes-root", "/v"),
            ("log-format", "json"),
            ("reconcile-interval", "60"),
            ("container-log-max-size", "10m"),
            ("container-log-max-files", "5"),
            ("image-gc-high-percent", "90"),
            ("image-gc-low-percent", "70"),
            ("dcgm-exporter-path", "/e"),
            ("dcgmi-path", "/d"),
            ("nv-hostengine-path", "/n"),
        ];
        let show = |c: &Config| format!("{c:?}");
        let reference = {
            let args: Vec<String> = values
                .iter()
                .flat_map(|(f, v)| [format!("--{f}"), (*v).to_owned()])
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            show(&ok(&args, &[]))
        };
        for (dashes, sep) in [("-", " "), ("-", "="), ("--", " "), ("--", "=")] {
            let mut args = Vec::new();
            for (f, v) in values {
                if sep == "=" {
                    args.push(format!("{dashes}{f}={v}"));
                } else {
                    args.push(format!("{dashes}{f}"));
                    args.push((*v).to_owned());
                }
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            assert_eq!(show(&ok(&args, &[])), reference, "{dashes}flag{sep}value");
        }
        for flag in ["privileged", "service"] {
            let on = |args: &[&str], env: &[(&str, &str)]| {
                let c = ok(args, env);
                if flag == "privileged" {
                    c.engine.privileged
                } else {
                    c.service
                }
            };
            let env = env::names(flag)[0];
            for dashes in ["-", "--"] {
                assert!(on(&[&format!("{dashes}{flag}")], &[]), "{dashes}{flag}");
                assert!(on(&[&format!("{dashes}{flag}=true")], &[]));
                assert!(on(&[&format!("{dashes}{flag}=1")], &[]));
                assert!(!on(&[&format!("{dashes}{flag}=false")], &[(env, "1")]));
                assert!(!on(&[&format!("{dashes}{flag}=0")], &[(env, "1")]));
            }
        }
        assert!(ok(&["-version"], &[]).version);
        assert!(ok(&["--v"], &[]).version);
        assert!(!ok(&["-version=false"], &[]).version);
    }

    #[test]
    fn one_version_string() {
        assert_eq!(
            VERSION,
            format!("{DSTACK_VERSION}+rust.{}", env!("CARGO_PKG_VERSION"))
        );
        assert!(
            !VERSION.contains(char::is_whitespace),
            "--version must print 3 words"
        );
        assert!(shim_http::is_release_at_least(
            VERSION,
            shim_http::MIN_COMPATIBLE_VERSION
        ));
    }
}
