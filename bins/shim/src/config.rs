//! Command line flags and environment variables.
//!
//! Names, defaults and environment variables follow dstack's Go `dstack-shim`, so this binary
//! is a drop-in replacement (SPEC §8). Our own additions: `--unix-socket`, `--volumes-root`
//! and the hidden, testing-only `--fake-gpus`.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use tracing_subscriber::filter::LevelFilter;

/// The binary's own version (`--version`, and what the component list reports for it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version the healthcheck answers. The dstack server gates features on it and treats
/// running tasks as restart-safe from 0.21.3 on; this shim implements the API of dstack 0.22.
pub const API_VERSION: &str = "0.22.0";

/// The environment variables passed into containers by default (proxies, both cases).
pub const DEFAULT_PASS_ENV: &str =
    "http_proxy,https_proxy,no_proxy,HTTP_PROXY,HTTPS_PROXY,NO_PROXY";

/// dstack-shim: runs GPU tasks as Docker containers for the dstack server and survives its
/// own restarts without killing them.
#[derive(Debug, Clone, Parser)]
#[command(name = "dstack-shim", disable_version_flag = true)]
pub struct Config {
    /// Print `dstack-shim version X` and exit.
    #[arg(long, short = 'v')]
    pub version: bool,

    /// The shim's home directory: task state, shim.log, host_info.json [default: ~/.dstack].
    #[arg(long, env = "DSTACK_SHIM_HOME", value_name = "DIR")]
    pub shim_home: Option<PathBuf>,

    /// The shim's own binary, as the component list reports and installs it [default: the
    /// running executable].
    #[arg(long, env = "DSTACK_SHIM_BINARY_PATH", value_name = "PATH")]
    pub shim_binary_path: Option<PathBuf>,

    /// The API port, on 127.0.0.1 only.
    #[arg(long, env = "DSTACK_SHIM_HTTP_PORT", default_value_t = 10998)]
    pub shim_http_port: u16,

    /// Log level: 0–6 as in dstack (2 error, 3 warn, 4 info, 5 debug, 6 trace) or a name.
    #[arg(long, env = "DSTACK_SHIM_LOG_LEVEL", default_value = "4")]
    pub shim_log_level: String,

    /// Download the runner from this URL at start when it is not installed.
    #[arg(long, env = "DSTACK_RUNNER_DOWNLOAD_URL", value_name = "URL")]
    pub runner_download_url: Option<String>,

    /// The runner binary on the host, bind-mounted into every container.
    #[arg(
        long,
        env = "DSTACK_RUNNER_BINARY_PATH",
        default_value = "/usr/local/bin/dstack-runner",
        value_name = "PATH"
    )]
    pub runner_binary_path: PathBuf,

    /// The runner's HTTP port in the container.
    #[arg(long, env = "DSTACK_RUNNER_HTTP_PORT", default_value_t = 10999)]
    pub runner_http_port: u16,

    /// The runner's SSH port in the container.
    #[arg(long, env = "DSTACK_RUNNER_SSH_PORT", default_value_t = 10022)]
    pub runner_ssh_port: u16,

    /// The runner's `--ssh-log-level` (not passed when empty).
    #[arg(long, env = "DSTACK_RUNNER_SSH_LOG_LEVEL", default_value = "")]
    pub runner_ssh_log_level: String,

    /// The runner's `--log-level`.
    #[arg(long, env = "DSTACK_RUNNER_LOG_LEVEL", default_value = "4")]
    pub runner_log_level: String,

    /// Comma-separated names of the shim's environment variables passed into containers.
    #[arg(long, env = "DSTACK_SHIM_PASS_ENV", default_value = DEFAULT_PASS_ENV, value_name = "NAMES")]
    pub pass_env: String,

    /// Run every container privileged.
    #[arg(long, env = "DSTACK_DOCKER_PRIVILEGED")]
    pub privileged: bool,

    /// Set `PJRT_DEVICE` in containers (e.g. TPU).
    #[arg(long, env = "PJRT_DEVICE", value_name = "DEVICE")]
    pub pjrt_device: Option<String>,

    /// Run as a service: write host_info.json to the home at start.
    #[arg(long, env = "DSTACK_SERVICE_MODE")]
    pub service: bool,

    /// Also serve the API on this Unix socket (mode 0600).
    #[arg(long, env = "DSTACK_SHIM_UNIX_SOCKET", value_name = "PATH")]
    pub unix_socket: Option<PathBuf>,

    /// Where volumes are mounted on the host.
    #[arg(
        long,
        env = "DSTACK_SHIM_VOLUMES_ROOT",
        default_value = "/mnt/disks/dstack-volumes",
        value_name = "DIR"
    )]
    pub volumes_root: PathBuf,

    /// Testing only: pretend the host has N GPUs.
    #[arg(long, hide = true, value_name = "N")]
    pub fake_gpus: Option<u32>,

    /// Accepted and ignored: old dstack servers start `dstack-shim docker ...`.
    #[arg(hide = true, value_parser = ["docker"])]
    pub legacy_mode: Option<String>,
}

impl Config {
    /// The home directory: `--shim-home`, or `~/.dstack`.
    pub fn home(&self) -> anyhow::Result<PathBuf> {
        if let Some(home) = &self.shim_home {
            return Ok(home.clone());
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
            Some(p) => Ok(p.clone()),
            None => std::env::current_exe().context("cannot find the running executable"),
        }
    }

    /// The names in `--pass-env`, trimmed, empty ones dropped.
    pub fn pass_env_names(&self) -> Vec<String> {
        self.pass_env
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The shim's log level as a tracing filter.
    pub fn log_level(&self) -> anyhow::Result<LevelFilter> {
        parse_level(&self.shim_log_level)
    }
}

/// dstack's numeric levels (logrus: 0 panic … 6 trace) or a level name.
pub fn parse_level(s: &str) -> anyhow::Result<LevelFilter> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "0" | "1" | "2" | "panic" | "fatal" | "error" => LevelFilter::ERROR,
        "3" | "warn" | "warning" => LevelFilter::WARN,
        "4" | "info" => LevelFilter::INFO,
        "5" | "debug" => LevelFilter::DEBUG,
        "6" | "trace" => LevelFilter::TRACE,
        "off" => LevelFilter::OFF,
        other => bail!("unknown log level {other:?}: use 0-6 or error, warn, info, debug, trace"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        Config::try_parse_from(std::iter::once("dstack-shim").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn defaults() {
        let c = parse(&[]);
        assert_eq!(c.shim_http_port, 10998);
        assert_eq!(c.runner_http_port, 10999);
        assert_eq!(c.runner_ssh_port, 10022);
        assert_eq!(
            c.runner_binary_path,
            PathBuf::from("/usr/local/bin/dstack-runner")
        );
        assert_eq!(c.runner_log_level, "4");
        assert_eq!(c.runner_ssh_log_level, "");
        assert_eq!(c.volumes_root, PathBuf::from("/mnt/disks/dstack-volumes"));
        assert!(!c.privileged && !c.service && !c.version);
        assert_eq!(
            c.pass_env_names(),
            [
                "http_proxy",
                "https_proxy",
                "no_proxy",
                "HTTP_PROXY",
                "HTTPS_PROXY",
                "NO_PROXY"
            ]
        );
        assert_eq!(c.log_level().unwrap(), LevelFilter::INFO);
    }

    #[test]
    fn flags() {
        let c = parse(&[
            "--shim-home",
            "/h",
            "--shim-http-port",
            "1234",
            "--shim-log-level",
            "6",
            "--runner-download-url",
            "https://x/r",
            "--runner-ssh-log-level",
            "DEBUG3",
            "--pass-env",
            " A, ,B ",
            "--privileged",
            "--pjrt-device",
            "TPU",
            "--service",
            "--unix-socket",
            "/run/s.sock",
            "--fake-gpus",
            "2",
        ]);
        assert_eq!(c.home().unwrap(), PathBuf::from("/h"));
        assert_eq!(c.shim_http_port, 1234);
        assert_eq!(c.log_level().unwrap(), LevelFilter::TRACE);
        assert_eq!(c.runner_download_url.as_deref(), Some("https://x/r"));
        assert_eq!(c.pass_env_names(), ["A", "B"]);
        assert!(c.privileged && c.service);
        assert_eq!(c.pjrt_device.as_deref(), Some("TPU"));
        assert_eq!(c.unix_socket, Some(PathBuf::from("/run/s.sock")));
        assert_eq!(c.fake_gpus, Some(2));
    }

    #[test]
    fn legacy_docker_subcommand_is_accepted() {
        let c = parse(&["docker", "--privileged"]);
        assert!(c.privileged);
        assert!(Config::try_parse_from(["dstack-shim", "podman"]).is_err());
    }

    #[test]
    fn levels() {
        assert_eq!(parse_level("2").unwrap(), LevelFilter::ERROR);
        assert_eq!(parse_level("3").unwrap(), LevelFilter::WARN);
        assert_eq!(parse_level("Debug").unwrap(), LevelFilter::DEBUG);
        assert!(parse_level("7").is_err());
        assert!(parse_level("loud").is_err());
    }

    #[test]
    fn api_version_is_a_compatible_release() {
        assert!(shim_http::is_release_at_least(
            API_VERSION,
            shim_http::MIN_COMPATIBLE_VERSION
        ));
    }

    #[test]
    fn help_renders() {
        use clap::CommandFactory;
        Config::command().debug_assert();
    }
}
