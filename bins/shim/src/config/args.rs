//! The flags, as clap defines them: each flag's name, value name and help line, one field of
//! [`Args`] each. Values stay raw strings here; [`super::Config::resolve`] reads them with
//! Go's rules, and [`crate::argv`] rewrites Go's flag syntax for clap first. The help ends
//! with the environment variables, generated from [`super::env::ENV`] ([`command`]).

use clap::{CommandFactory as _, Parser};

use super::env;

/// The command line as given (values raw; see [`super::Config::resolve`]).
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "dstack-shim",
    disable_version_flag = true,
    disable_help_flag = true,
    about = "Starts dstack-runner or docker container."
)]
pub struct Args {
    /// Print `dstack-shim version X` and exit.
    #[arg(long, short = 'v')]
    pub version: bool,
    /// Print this help and exit (also `dstack-shim help`).
    #[arg(long, short = 'h')]
    pub help: bool,
    /// Set shim's home directory [default: ~/.dstack]
    #[arg(long, value_name = "DIR")]
    pub shim_home: Option<String>,
    /// Path to shim's binary [default: the running executable]
    #[arg(long, value_name = "PATH")]
    pub shim_binary_path: Option<String>,
    /// Set shim's http port (on 127.0.0.1) [default: 10998]
    #[arg(long, value_name = "PORT")]
    pub shim_http_port: Option<String>,
    /// Set shim's log level: 1-6 or fatal, error, warn, info, debug, trace [default: info]
    #[arg(long, value_name = "LEVEL")]
    pub shim_log_level: Option<String>,
    /// Set runner's download URL
    #[arg(long, value_name = "URL")]
    pub runner_download_url: Option<String>,
    /// Path to runner's binary [default: /usr/local/bin/dstack-runner]
    #[arg(long, value_name = "PATH")]
    pub runner_binary_path: Option<String>,
    /// Set runner's http port [default: 10999]
    #[arg(long, value_name = "PORT")]
    pub runner_http_port: Option<String>,
    /// Set runner's ssh port [default: 10022]
    #[arg(long, value_name = "PORT")]
    pub runner_ssh_port: Option<String>,
    /// Set runner's ssh log level
    #[arg(long, value_name = "LEVEL")]
    pub runner_ssh_log_level: Option<String>,
    /// Set runner's log level [default: info]
    #[arg(long, value_name = "LEVEL")]
    pub runner_log_level: Option<String>,
    /// DCGM Exporter http port [default: 10997]
    #[arg(long, value_name = "PORT")]
    pub dcgm_exporter_http_port: Option<String>,
    /// DCGM Exporter collect interval, milliseconds [default: 5000]
    #[arg(long, value_name = "MS")]
    pub dcgm_exporter_interval: Option<String>,
    /// nv-hostengine hostname, e.g., localhost [default: a private nv-hostengine]
    #[arg(long, value_name = "HOSTNAME")]
    pub dcgm_address: Option<String>,
    /// Environment variables to pass on to the container, a comma-separated list of names
    #[arg(long, value_name = "NAMES")]
    pub pass_env: Option<String>,
    /// Give extended privileges to the container
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub privileged: Option<String>,
    /// Set the PJRT_DEVICE environment variable (e.g., TPU, GPU)
    #[arg(long, value_name = "DEVICE")]
    pub pjrt_device: Option<String>,
    /// Start as a service (write host_info.json to the home at start)
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub service: Option<String>,
    /// Also serve the API on this Unix socket (mode 0600)
    #[arg(long, value_name = "PATH")]
    pub unix_socket: Option<String>,
    /// Where volumes are mounted on the host [default: /mnt/disks/dstack-volumes]
    #[arg(long, value_name = "DIR")]
    pub volumes_root: Option<String>,
    /// Log format: text or json [default: text]
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// Seconds between full container lists (a backstop: Docker's events drive the
    /// reconciler) [default: 300]
    #[arg(long, value_name = "SECONDS")]
    pub reconcile_interval: Option<String>,
    /// Rotate each container's log (Docker's json-file driver) at this size: a number with
    /// an optional unit k, m or g (powers of 1024), or `daemon` to leave the daemon's own log
    /// configuration [default: 100m]
    #[arg(long, value_name = "SIZE")]
    pub container_log_max_size: Option<String>,
    /// Log files kept per container, the current one included (1 or more) [default: 3]
    #[arg(long, value_name = "N")]
    pub container_log_max_files: Option<String>,
    /// Fail an image pull when the engine reports no progress for this long: a Go duration
    /// (`10m`, `90s`, `1h`), or 0 for never [default: 10m]
    #[arg(long, value_name = "DURATION")]
    pub pull_stall_timeout: Option<String>,
    /// The longest an image pull may take, moving or not: a Go duration (`2h`, `90m`), or 0
    /// for no limit [default: 0, none: a pull ends on a stall, not on a clock]
    #[arg(long, value_name = "DURATION")]
    pub pull_timeout: Option<String>,
    /// Collect unused images this shim pulled when the engine's image file system is used
    /// above this percentage (0 to 100; 100 turns collection off) [default: 85]
    #[arg(long, value_name = "PERCENT")]
    pub image_gc_high_percent: Option<String>,
    /// Collect down to this percentage (below the high one) [default: 80]
    #[arg(long, value_name = "PERCENT")]
    pub image_gc_low_percent: Option<String>,
    /// How a task's GPUs reach its container: `auto` (CDI devices where the engine applies
    /// CDI and a spec names the GPUs, else upstream's NVIDIA device request and device
    /// mappings), `cdi` (CDI only: GPU tasks fail where it cannot work), `legacy` (never CDI)
    /// [default: auto]
    #[arg(long, value_name = "MODE")]
    pub gpu_device_mode: Option<String>,
    /// How often the GPUs' health is probed on an NVIDIA host (`nvidia-smi -q` retired pages
    /// and row remapping, XIDs in the kernel log, DCGM where it runs; an unhealthy GPU is not
    /// given to new tasks): a Go duration up to 24h, or 0 for never [default: 30s]
    #[arg(long, value_name = "DURATION")]
    pub gpu_health_interval: Option<String>,
    /// XIDs that do not make a GPU unhealthy, beyond the application errors NVIDIA's device
    /// plugin skips (13, 31, 43, 45, 68, 109): comma-separated, or `all`/`xids` to ignore
    /// XIDs (the device plugin's DP_DISABLE_HEALTHCHECKS) [default: none]
    #[arg(long, value_name = "XIDS")]
    pub disable_gpu_healthchecks: Option<String>,
    /// The dcgm-exporter binary [default: dcgm-exporter in PATH]
    #[arg(long, value_name = "PATH")]
    pub dcgm_exporter_path: Option<String>,
    /// The dcgmi binary [default: dcgmi in PATH]
    #[arg(long, value_name = "PATH")]
    pub dcgmi_path: Option<String>,
    /// The nv-hostengine binary [default: nv-hostengine in PATH]
    #[arg(long, value_name = "PATH")]
    pub nv_hostengine_path: Option<String>,
    /// Testing only: pretend the host has N GPUs.
    #[arg(long, hide = true, value_name = "N")]
    pub fake_gpus: Option<String>,
    /// Ignored (old servers start `dstack-shim docker ...`); `help` shows this help.
    #[arg(hide = true)]
    pub positional: Vec<String>,
}

/// The clap command of [`Args`] with the help's closing paragraph generated from the
/// environment table ([`env::help`]): what `dstack-shim help` prints.
pub fn command() -> clap::Command {
    Args::command().after_help(env::help())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_renders() {
        command().debug_assert();
    }

    /// Every flag the environment table names is a flag of the command line, and every flag
    /// with a value is in the table, so the generated help names each variable once.
    #[test]
    fn the_environment_table_and_the_flags_agree() {
        let command = command();
        let flags: Vec<&str> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|f| !["version", "help", "fake-gpus"].contains(f))
            .collect();
        let table: Vec<&str> = env::ENV.iter().map(|(flag, _)| *flag).collect();
        assert_eq!(flags, table, "the flags in their order, and the table's");
        let help = command.clone().render_help().to_string();
        let variables = env::help();
        assert!(help.trim_end().ends_with(&variables), "{help}");
        for (_, names) in env::ENV {
            for name in *names {
                assert_eq!(variables.matches(name).count(), 1, "{name} in {variables}");
            }
        }
    }
}
