//! The engine's configuration: paths, runner parameters, container defaults, timings.

use std::path::PathBuf;
use std::time::Duration;

/// How the engine runs tasks. Built by the binary from its flags; embedders fill it in.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The shim home: task directories live under `<home>/tasks`, and the owner identity that
    /// scopes which containers are ours is derived from this path.
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
    /// The longest an image pull may take.
    pub pull_timeout: Duration,
    /// The period of the full container list, the backstop for lost events.
    pub reconcile_interval: Duration,
    /// Lines of log reported for a container that exited with an error.
    pub exit_log_lines: usize,
    /// How much longer than its stop timeout a terminate may take before it answers with
    /// what is done so far (SPEC §4: within `timeout` + 5 s; the dstack server sends
    /// `timeout: 0` and gives up after 9 s). What is not done by then finishes in the
    /// background.
    pub terminate_slack: Duration,
}

impl EngineConfig {
    /// A config with SPEC's defaults for everything but the home.
    pub fn new(home: impl Into<PathBuf>) -> Self {
        Self {
            home: home.into(),
            runner_binary_path: PathBuf::from("/usr/local/bin/dstack-runner"),
            runner_http_port: 10999,
            runner_ssh_port: 10022,
            runner_log_level: "4".to_owned(),
            runner_ssh_log_level: None,
            pass_env: default_pass_env(),
            privileged: false,
            pjrt_device: None,
            volumes_root: PathBuf::from("/mnt/disks/dstack-volumes"),
            pull_timeout: Duration::from_secs(20 * 60),
            reconcile_interval: Duration::from_secs(1),
            exit_log_lines: 5,
            terminate_slack: Duration::from_secs(4),
        }
    }
}

/// The proxy variables, both cases.
pub fn default_pass_env() -> Vec<String> {
    ["http_proxy", "https_proxy", "no_proxy"]
        .iter()
        .flat_map(|v| [v.to_string(), v.to_uppercase()])
        .collect()
}
