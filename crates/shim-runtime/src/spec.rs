//! The runtime-neutral container spec, and the pure functions that build the task container of
//! SPEC §6 from neutral inputs (no IO here: whatever depends on the host is an input).

use std::collections::BTreeMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use shim_task::NetworkMode;

/// Where the runner directory is mounted inside the container.
pub const RUNNER_DIR_IN_CONTAINER: &str = "/tmp/runner";
/// Where the runner binary is mounted inside the container.
pub const RUNNER_BINARY_IN_CONTAINER: &str = "/usr/local/bin/dstack-runner";
/// The exit code of the container command when `sshd` is missing and no package manager is
/// found.
pub const EXIT_NO_PACKAGE_MANAGER: i64 = 11;
/// The exit code of the container command when installing `sshd` failed.
pub const EXIT_SSHD_INSTALL_FAILED: i64 = 12;
/// The NVIDIA driver capabilities requested for GPU containers.
pub const NVIDIA_CAPABILITIES: [&str; 7] = [
    "gpu", "utility", "compute", "graphics", "video", "display", "compat32",
];
/// The path of InfiniBand devices (mapped when present on the host).
pub const INFINIBAND_PATH: &str = "/dev/infiniband";
/// The 1 GiB hugepages mount (bound for Tenstorrent when present on the host).
pub const HUGEPAGES_1G_PATH: &str = "/dev/hugepages-1G";

/// A bind mount: Docker `Mounts` of type `bind`, as upstream makes them, so a missing source
/// fails the create instead of becoming a directory Docker creates on the host.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BindMount {
    /// The host path.
    pub source: PathBuf,
    /// The path inside the container.
    pub target: String,
    /// Whether the container sees it read-only.
    pub read_only: bool,
}

/// A host device mapped into the container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceMapping {
    /// The device on the host.
    pub path_on_host: String,
    /// The path inside the container.
    pub path_in_container: String,
    /// The cgroup permissions (`rwm`).
    pub cgroup_permissions: String,
}

impl DeviceMapping {
    /// Maps a device to the same path inside the container, with `rwm`.
    pub fn same_path(path: &str) -> Self {
        Self {
            path_on_host: path.to_owned(),
            path_in_container: path.to_owned(),
            cgroup_permissions: "rwm".to_owned(),
        }
    }
}

/// A device request: upstream's NVIDIA one (driver `nvidia`, GPU UUIDs, capabilities) or a
/// CDI one (driver [`CDI_DRIVER`], fully qualified CDI device names, no capabilities).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceRequest {
    /// The driver (`nvidia`, `cdi`).
    pub driver: String,
    /// Device ids (GPU UUIDs; CDI names `vendor.com/class=name`).
    pub device_ids: Vec<String>,
    /// Capabilities, all required together (none for CDI).
    pub capabilities: Vec<String>,
}

/// The device request driver of CDI devices (Docker 25+ with CDI on, Podman 5+).
pub const CDI_DRIVER: &str = "cdi";

/// Where engines read CDI specs unless told otherwise (the CDI spec's defaults): `/etc/cdi`
/// (static specs), then `/var/run/cdi` (generated ones, which take precedence).
pub const DEFAULT_CDI_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// A resource limit (`ulimit`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Ulimit {
    /// The name (`memlock`, …).
    pub name: String,
    /// The soft limit (`-1` = unlimited).
    pub soft: i64,
    /// The hard limit (`-1` = unlimited).
    pub hard: i64,
}

/// Bounds on a container's log: Docker's `json-file` driver (the daemon's default driver,
/// whose files `docker logs`, log shippers and [`crate::ContainerRuntime::logs_tail`] read),
/// rotated when the current file reaches `max_size` bytes, `max_files` files kept (the current
/// one included).
///
/// On Docker the log then takes at most `max_size × max_files` bytes, plus one log line per
/// file (a file is rotated before the first write after it reached the size). Podman reads
/// `json-file` as its `k8s-file` driver (the container's `LogPath`) and applies `max_size` to
/// that one file (conmon truncates it when full); it keeps no rotated files and ignores
/// `max_files`. The size goes to the engine in bytes: Docker reads units in powers of 1024,
/// Podman in powers of 1000, so a plain byte count means the same on both.
///
/// Built with [`LogLimits::new`] (`#[non_exhaustive]`: a field added in a later version breaks
/// no embedder).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LogLimits {
    /// The size at which the current log file is rotated, in bytes (`max-size`).
    pub max_size: NonZeroU64,
    /// How many log files are kept, the current one included (`max-file`).
    pub max_files: NonZeroU32,
}

impl LogLimits {
    /// The log driver the limits are given to.
    pub const DRIVER: &'static str = "json-file";

    /// Logs rotated at `max_size` bytes, `max_files` files kept.
    pub const fn new(max_size: NonZeroU64, max_files: NonZeroU32) -> Self {
        Self {
            max_size,
            max_files,
        }
    }

    /// The most the log's files hold together on Docker, in bytes (`max_size × max_files`,
    /// saturating), not counting the one line a file may exceed its size by.
    pub fn total_bytes(&self) -> u64 {
        self.max_size
            .get()
            .saturating_mul(u64::from(self.max_files.get()))
    }

    /// The driver's options: `max-size` (bytes) and `max-file`, as Docker's API takes them.
    pub fn options(&self) -> [(&'static str, String); 2] {
        [
            ("max-size", self.max_size.to_string()),
            ("max-file", self.max_files.to_string()),
        ]
    }
}

impl std::fmt::Display for LogLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} max-size={} max-file={}",
            Self::DRIVER,
            self.max_size,
            self.max_files
        )
    }
}

/// Everything needed to create a container, independent of the runtime.
///
/// Built by [`build_container_spec`] for a task, or with [`ContainerSpec::new`] and then the
/// fields that differ from their defaults (`#[non_exhaustive]`: a field added in a later
/// version breaks no embedder).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ContainerSpec {
    /// The container name.
    pub name: String,
    /// The image reference.
    pub image: String,
    /// The entrypoint (empty = the image's).
    pub entrypoint: Vec<String>,
    /// The command (empty = the image's).
    pub cmd: Vec<String>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Environment variables, in order.
    pub env: Vec<(String, String)>,
    /// Bind mounts.
    pub mounts: Vec<BindMount>,
    /// Size of `/dev/shm` in bytes (`None` = the runtime's default).
    pub shm_size: Option<i64>,
    /// tmpfs mounts: path → mount options (e.g. `/dev/shm` → `exec,size=N`).
    pub tmpfs: BTreeMap<String, String>,
    /// The network mode.
    pub network: NetworkMode,
    /// TCP ports published on `127.0.0.1` with ephemeral host ports (bridge mode only).
    pub published_ports: Vec<u16>,
    /// CPU limit in nano-CPUs (0 = none).
    pub nano_cpus: i64,
    /// Memory limit in bytes (0 = none).
    pub memory: i64,
    /// Privileged container.
    pub privileged: bool,
    /// The user (empty = the image's).
    pub user: String,
    /// Devices mapped into the container.
    pub devices: Vec<DeviceMapping>,
    /// Device requests.
    pub device_requests: Vec<DeviceRequest>,
    /// Added capabilities.
    pub cap_add: Vec<String>,
    /// The IPC mode (`host`), `None` = default.
    pub ipc_mode: Option<String>,
    /// Security options (`seccomp=unconfined`).
    pub security_opt: Vec<String>,
    /// The OCI runtime (`habana`), `None` = default.
    pub runtime: Option<String>,
    /// Resource limits.
    pub ulimits: Vec<Ulimit>,
    /// The log's bounds (`json-file` with rotation); `None` = the daemon's own log
    /// configuration (its `log-driver` and `log-opts`).
    pub log: Option<LogLimits>,
}

impl ContainerSpec {
    /// A container named `name` of `image`, everything else the runtime's default (the
    /// image's entrypoint and command, no mounts, no limits, host network).
    pub fn new(name: impl Into<String>, image: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            image: image.into(),
            ..Self::default()
        }
    }
}

/// The accelerators given to a container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GpuConfig {
    /// No accelerators.
    #[default]
    None,
    /// NVIDIA GPUs by UUID (upstream's device request, driver `nvidia`: needs NVIDIA's
    /// runtime hook on the host; Podman ignores it).
    Nvidia {
        /// GPU UUIDs.
        uuids: Vec<String>,
    },
    /// Devices by their CDI names (`nvidia.com/gpu=GPU-…`, `amd.com/gpu=0`): a device request
    /// of driver [`CDI_DRIVER`]; the engine applies the host's CDI spec (device nodes, env,
    /// mounts, hooks).
    Cdi {
        /// Fully qualified CDI device names.
        devices: Vec<String>,
        /// AMD's GPUs: the container also gets what upstream gives AMD GPUs and a CDI spec
        /// cannot carry (the host's IPC namespace, `SYS_PTRACE`, seccomp unconfined), as
        /// [`GpuConfig::Amd`] does.
        amd: bool,
    },
    /// AMD GPUs by render node (`/dev/dri/renderD128`).
    Amd {
        /// Render node paths.
        render_nodes: Vec<String>,
    },
    /// Tenstorrent devices by id (`/dev/tenstorrent/<id>`).
    Tenstorrent {
        /// Device ids.
        ids: Vec<String>,
    },
    /// Intel Gaudi devices by index.
    Intel {
        /// Device ids.
        ids: Vec<String>,
    },
    /// Plain device mappings given by the task, replacing the vendor logic.
    Devices(Vec<DeviceMapping>),
}

/// Host facts the spec depends on (checked by the caller, [`HostDevices::probe`]; the builder
/// does no IO).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostDevices {
    /// `/dev/infiniband` exists on the host.
    pub infiniband: bool,
    /// `/dev/hugepages-1G` exists on the host.
    pub hugepages_1g: bool,
}

impl HostDevices {
    /// This host's facts: whether [`INFINIBAND_PATH`] and [`HUGEPAGES_1G_PATH`] exist.
    pub fn probe() -> Self {
        Self {
            infiniband: std::path::Path::new(INFINIBAND_PATH).exists(),
            hugepages_1g: std::path::Path::new(HUGEPAGES_1G_PATH).exists(),
        }
    }
}

/// How the runner is started inside the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerParams {
    /// The runner binary on the host (mounted read-only at [`RUNNER_BINARY_IN_CONTAINER`]).
    pub binary_host_path: PathBuf,
    /// The task's runner directory on the host (mounted at [`RUNNER_DIR_IN_CONTAINER`]).
    pub dir_host_path: PathBuf,
    /// The runner's HTTP port.
    pub http_port: u16,
    /// The runner's SSH port.
    pub ssh_port: u16,
    /// The runner's log level.
    pub log_level: String,
    /// The runner's sshd log level, if set.
    pub ssh_log_level: Option<String>,
    /// Pass `--http-address localhost` (host network mode).
    pub http_address_localhost: bool,
    /// Public keys the runner's sshd accepts (already validated by the caller).
    pub authorized_keys: Vec<String>,
}

/// Everything the task container is built from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerInputs {
    /// The container name.
    pub name: String,
    /// The image reference.
    pub image: String,
    /// Labels (task marker, task id, owner identity).
    pub labels: BTreeMap<String, String>,
    /// The runner.
    pub runner: RunnerParams,
    /// The network mode.
    pub network: NetworkMode,
    /// The user (empty = the image's).
    pub user: String,
    /// Privileged container.
    pub privileged: bool,
    /// CPU limit in nano-CPUs (0 = none), see [`nano_cpus`].
    pub nano_cpus: i64,
    /// Memory limit in bytes (0 = none).
    pub memory: i64,
    /// `/dev/shm` size in bytes (0 = the engine's default, noexec: 64 MiB on Docker,
    /// 64000 KiB on Podman).
    pub shm_size: i64,
    /// Extra bind mounts (volumes, instance mounts).
    pub mounts: Vec<BindMount>,
    /// Environment passed through from the shim (name, value), in order.
    pub env: Vec<(String, String)>,
    /// `PJRT_DEVICE`, when configured.
    pub pjrt_device: Option<String>,
    /// Accelerators.
    pub gpu: GpuConfig,
    /// Host facts.
    pub host: HostDevices,
    /// The log's bounds; `None` = the daemon's own log configuration.
    pub log: Option<LogLimits>,
}

/// The image reference to pull and run: a reference without a tag or digest gets `:latest`.
/// The one place of this rule: Docker pulls *every* tag of a bare name, and the engine skips
/// the pull of a present image unless its tag is `latest`, so both must see the tagged form.
pub fn with_default_tag(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    if image.contains('@') || last.contains(':') {
        image.to_owned()
    } else {
        format!("{image}:latest")
    }
}

/// An image reference in the one form two spellings of the same name share: registry,
/// repository path, then tag (`:latest` when none) and digest, as Docker's reference library
/// normalises it (`ParseNormalizedNamed`): `ubuntu:22.04` and
/// `docker.io/library/ubuntu:22.04` (and `index.docker.io/library/ubuntu:22.04`) are one
/// name; a first component with a `.` or a `:`, or `localhost`, is a registry. Names are
/// compared in this form wherever the shim asks "is this the same image name" (the image
/// ledger, the in-use check, an engine's `RepoTags`, which Docker spells familiar and Podman
/// in full).
pub fn normalize_reference(image: &str) -> String {
    let image = image.trim();
    let (named, digest) = match image.split_once('@') {
        Some((named, digest)) => (named, Some(digest)),
        None => (image, None),
    };
    let last = named.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match named[last..].rfind(':') {
        Some(i) => (&named[..last + i], Some(&named[last + i + 1..])),
        None => (named, None),
    };
    let (domain, path) = match name.split_once('/') {
        Some((first, rest)) if first.contains(['.', ':']) || first == "localhost" => (first, rest),
        _ => ("docker.io", name),
    };
    let domain = if domain == "index.docker.io" {
        "docker.io"
    } else {
        domain
    };
    let mut out = String::with_capacity(image.len() + 24);
    out.push_str(domain);
    out.push('/');
    if domain == "docker.io" && !path.contains('/') {
        out.push_str("library/");
    }
    out.push_str(path);
    match (tag, digest) {
        (Some(tag), _) => {
            out.push(':');
            out.push_str(tag);
        }
        (None, None) => out.push_str(":latest"),
        (None, Some(_)) => {}
    }
    if let Some(digest) = digest {
        out.push('@');
        out.push_str(digest);
    }
    out
}

/// Converts a CPU count (`0` = unlimited) to nano-CPUs.
pub fn nano_cpus(cpu: f64) -> i64 {
    if cpu.is_finite() && cpu > 0.0 {
        (cpu * 1e9).round() as i64
    } else {
        0
    }
}

/// Quotes `s` as one word for `sh`.
pub fn shell_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        if c == '\'' {
            out.push_str("'\\''");
        } else {
            out.push(c);
        }
    }
    out.push('\'');
    out
}

/// The `/bin/sh -c` script of the task container: make sure `sshd` exists (installing it with
/// apt-get, yum or apk; exit [`EXIT_NO_PACKAGE_MANAGER`] if there is none,
/// [`EXIT_SSHD_INSTALL_FAILED`] if installing fails), then exec the runner.
///
/// The check and the install run in a subshell with `LD_LIBRARY_PATH` and `LD_PRELOAD`
/// unset, so an image's preloaded libraries cannot break the package manager; the runner
/// keeps the image's values (upstream `runner/internal/shim/docker.go`,
/// `getSSHShellCommands`, dstack issue #1769).
pub fn runner_script(runner: &RunnerParams) -> String {
    let mut script = String::from(
        "( unset LD_LIBRARY_PATH; unset LD_PRELOAD; \
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then \
if command -v apt-get >/dev/null 2>&1; then \
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server; }; \
elif command -v yum >/dev/null 2>&1; then yum -y -q install openssh-server; \
elif command -v apk >/dev/null 2>&1; then apk add -q --no-cache openssh-server; \
else echo 'sshd is missing and no package manager (apt-get, yum, apk) was found' >&2; exit 11; fi \
|| { echo 'installing openssh-server failed' >&2; exit 12; }; \
fi ) || exit $?; exec ",
    );
    let mut args = vec![
        RUNNER_BINARY_IN_CONTAINER.to_owned(),
        "--log-level".to_owned(),
        runner.log_level.clone(),
        "start".to_owned(),
        "--temp-dir".to_owned(),
        RUNNER_DIR_IN_CONTAINER.to_owned(),
        "--http-port".to_owned(),
        runner.http_port.to_string(),
        "--ssh-port".to_owned(),
        runner.ssh_port.to_string(),
    ];
    if runner.http_address_localhost {
        args.push("--http-address".to_owned());
        args.push("localhost".to_owned());
    }
    for key in &runner.authorized_keys {
        args.push("--ssh-authorized-key".to_owned());
        args.push(key.clone());
    }
    if let Some(level) = &runner.ssh_log_level {
        args.push("--ssh-log-level".to_owned());
        args.push(level.clone());
    }
    let quoted: Vec<String> = args.iter().map(|a| shell_quote(a)).collect();
    script.push_str(&quoted.join(" "));
    script
}

/// What upstream gives a container of AMD GPUs besides the devices (`configureGpus`, the AMD
/// case: ROCm's IPC between processes, debuggers and RCCL): the host's IPC namespace,
/// `SYS_PTRACE` and seccomp unconfined.
fn amd_process_settings(spec: &mut ContainerSpec) {
    spec.ipc_mode = Some("host".to_owned());
    spec.cap_add.push("SYS_PTRACE".to_owned());
    spec.security_opt.push("seccomp=unconfined".to_owned());
}

/// Builds the task container's spec (SPEC §6) from its inputs.
pub fn build_container_spec(inputs: &ContainerInputs) -> ContainerSpec {
    let mut spec = ContainerSpec {
        name: inputs.name.clone(),
        image: inputs.image.clone(),
        entrypoint: vec!["/bin/sh".to_owned(), "-c".to_owned()],
        cmd: vec![runner_script(&inputs.runner)],
        labels: inputs.labels.clone(),
        env: inputs.env.clone(),
        network: inputs.network,
        nano_cpus: inputs.nano_cpus.max(0),
        memory: inputs.memory.max(0),
        privileged: inputs.privileged,
        user: inputs.user.clone(),
        log: inputs.log,
        ..ContainerSpec::default()
    };
    if let Some(device) = &inputs.pjrt_device {
        spec.env.push(("PJRT_DEVICE".to_owned(), device.clone()));
    }
    spec.mounts.push(BindMount {
        source: inputs.runner.dir_host_path.clone(),
        target: RUNNER_DIR_IN_CONTAINER.to_owned(),
        read_only: false,
    });
    // Upstream binds it read-write (runner/internal/shim/docker.go, `DockerMounts`); here it
    // is read-only: the shim itself runs `<runner binary> --version` on the host (the
    // components list), so a container that could write it could run code on the host.
    spec.mounts.push(BindMount {
        source: inputs.runner.binary_host_path.clone(),
        target: RUNNER_BINARY_IN_CONTAINER.to_owned(),
        read_only: true,
    });
    spec.mounts.extend(inputs.mounts.iter().cloned());
    if inputs.shm_size > 0 {
        spec.shm_size = Some(inputs.shm_size);
        spec.tmpfs.insert(
            "/dev/shm".to_owned(),
            format!("exec,size={}", inputs.shm_size),
        );
    }
    if inputs.network == NetworkMode::Bridge {
        spec.published_ports = vec![inputs.runner.http_port, inputs.runner.ssh_port];
        spec.published_ports.dedup();
    }
    apply_gpu(&mut spec, &inputs.gpu, inputs.host);
    if inputs.host.infiniband {
        spec.devices.push(DeviceMapping::same_path(INFINIBAND_PATH));
        spec.ulimits.push(Ulimit {
            name: "memlock".to_owned(),
            soft: -1,
            hard: -1,
        });
    }
    spec
}

fn apply_gpu(spec: &mut ContainerSpec, gpu: &GpuConfig, host: HostDevices) {
    match gpu {
        GpuConfig::None => {}
        GpuConfig::Nvidia { uuids } => {
            if !uuids.is_empty() {
                spec.device_requests.push(DeviceRequest {
                    driver: "nvidia".to_owned(),
                    device_ids: uuids.clone(),
                    capabilities: NVIDIA_CAPABILITIES
                        .iter()
                        .map(|c| (*c).to_owned())
                        .collect(),
                });
            }
        }
        GpuConfig::Cdi { devices, amd } => {
            if !devices.is_empty() {
                spec.device_requests.push(DeviceRequest {
                    driver: CDI_DRIVER.to_owned(),
                    device_ids: devices.clone(),
                    capabilities: Vec::new(),
                });
                if *amd {
                    amd_process_settings(spec);
                }
            }
        }
        GpuConfig::Amd { render_nodes } => {
            spec.devices.push(DeviceMapping::same_path("/dev/kfd"));
            spec.devices
                .extend(render_nodes.iter().map(|n| DeviceMapping::same_path(n)));
            amd_process_settings(spec);
        }
        GpuConfig::Tenstorrent { ids } => {
            spec.devices.extend(
                ids.iter()
                    .map(|id| DeviceMapping::same_path(&format!("/dev/tenstorrent/{id}"))),
            );
            if host.hugepages_1g {
                spec.mounts.push(BindMount {
                    source: PathBuf::from(HUGEPAGES_1G_PATH),
                    target: HUGEPAGES_1G_PATH.to_owned(),
                    read_only: false,
                });
            }
        }
        GpuConfig::Intel { ids } => {
            spec.runtime = Some("habana".to_owned());
            spec.ipc_mode = Some("host".to_owned());
            spec.cap_add.push("SYS_NICE".to_owned());
            spec.env
                .push(("HABANA_VISIBLE_DEVICES".to_owned(), ids.join(",")));
        }
        GpuConfig::Devices(devices) => spec.devices.extend(devices.iter().cloned()),
    }
}

/// The NVIDIA display-capability retry: when a start failed because of `/dev/nvidia-modeset`
/// and the spec requests the `display` capability, the same spec without it (the engine
/// recreates the container and retries once). `None` when the retry does not apply.
pub fn without_nvidia_display(spec: &ContainerSpec, start_error: &str) -> Option<ContainerSpec> {
    if !start_error.contains("/dev/nvidia-modeset") {
        return None;
    }
    let mut changed = false;
    let mut retry = spec.clone();
    for request in &mut retry.device_requests {
        let before = request.capabilities.len();
        request.capabilities.retain(|c| c != "display");
        changed |= request.capabilities.len() != before;
    }
    changed.then_some(retry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    // upstream: runner/internal/shim/docker.go (pullImage) adds `:latest` when the name has no
    // `:`; a registry port (`host:5000/x`) is not a tag here, and a digest keeps the name as is.
    #[test]
    fn default_tag() {
        assert_eq!(with_default_tag("ubuntu"), "ubuntu:latest");
        assert_eq!(with_default_tag("ubuntu:22.04"), "ubuntu:22.04");
        assert_eq!(
            with_default_tag("127.0.0.1:5799/x"),
            "127.0.0.1:5799/x:latest"
        );
        assert_eq!(with_default_tag("127.0.0.1:5799/x:1"), "127.0.0.1:5799/x:1");
        assert_eq!(with_default_tag("x@sha256:abc"), "x@sha256:abc");
        assert_eq!(with_default_tag("a/b@sha256:00"), "a/b@sha256:00");
    }

    // Docker's reference library (distribution/reference `ParseNormalizedNamed`,
    // normalize.go): a first component with `.`/`:` or `localhost` is a registry; Docker Hub
    // names get `docker.io/` and one-component ones `library/`; `index.docker.io` is
    // `docker.io`.
    #[test]
    fn normalized_references() {
        for (a, b) in [
            ("ubuntu", "docker.io/library/ubuntu:latest"),
            ("ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
            (
                "docker.io/library/ubuntu:22.04",
                "docker.io/library/ubuntu:22.04",
            ),
            (
                "index.docker.io/library/ubuntu:22.04",
                "docker.io/library/ubuntu:22.04",
            ),
            ("docker.io/ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
            ("dstackai/base:py3.12", "docker.io/dstackai/base:py3.12"),
            ("127.0.0.1:5799/x", "127.0.0.1:5799/x:latest"),
            ("127.0.0.1:5799/a/b:1", "127.0.0.1:5799/a/b:1"),
            ("localhost/x:1", "localhost/x:1"),
            (
                "nvcr.io/nvidia/pytorch:24.01-py3",
                "nvcr.io/nvidia/pytorch:24.01-py3",
            ),
            ("x@sha256:ab", "docker.io/library/x@sha256:ab"),
            ("r.io/x:1@sha256:ab", "r.io/x:1@sha256:ab"),
        ] {
            assert_eq!(normalize_reference(a), b, "{a}");
            assert_eq!(normalize_reference(b), b, "{b} is its own form");
        }
        assert_eq!(
            normalize_reference("ubuntu:22.04"),
            normalize_reference("docker.io/library/ubuntu:22.04")
        );
        assert_ne!(
            normalize_reference("ubuntu:22.04"),
            normalize_reference("ubuntu:24.04")
        );
    }

    fn inputs() -> ContainerInputs {
        ContainerInputs {
            name: "task-1234abcd".to_owned(),
            image: "ubuntu:22.04".to_owned(),
            labels: BTreeMap::from([("ai.dstack.shim.task".to_owned(), "t1".to_owned())]),
            runner: RunnerParams {
                binary_host_path: PathBuf::from("/opt/dstack-runner"),
                dir_host_path: PathBuf::from("/home/x/.dstack/tasks/t1/runner"),
                http_port: 10999,
                ssh_port: 10022,
                log_level: "4".to_owned(),
                ssh_log_level: None,
                http_address_localhost: true,
                authorized_keys: vec![],
            },
            ..ContainerInputs::default()
        }
    }

    #[test]
    fn shell_quote_escapes_single_quotes() {
        assert_eq!(shell_quote("abc"), "'abc'");
        assert_eq!(shell_quote("a'b"), "'a'\\''b'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$(rm -rf /) `x`"), "'$(rm -rf /) `x`'");
    }

    #[test]
    fn script_starts_runner_with_flags() {
        let mut runner = inputs().runner;
        runner.authorized_keys = vec![
            "ssh-ed25519 AAAAC3Nz me@host".to_owned(),
            "ssh-rsa AAAAB3 it's".to_owned(),
        ];
        runner.ssh_log_level = Some("DEBUG".to_owned());
        let script = runner_script(&runner);
        assert!(script.ends_with(
            "exec '/usr/local/bin/dstack-runner' '--log-level' '4' 'start' '--temp-dir' \
'/tmp/runner' '--http-port' '10999' '--ssh-port' '10022' '--http-address' 'localhost' \
'--ssh-authorized-key' 'ssh-ed25519 AAAAC3Nz me@host' '--ssh-authorized-key' \
'ssh-rsa AAAAB3 it'\\''s' '--ssh-log-level' 'DEBUG'"
        ));
        assert!(script.contains("apt-get install"));
        assert!(script.contains("yum -y -q install openssh-server"));
        assert!(script.contains("apk add"));
        assert!(script.contains("exit 11"));
    }

    /// The sshd check and install see no `LD_LIBRARY_PATH`/`LD_PRELOAD`; the runner keeps
    /// them (upstream `runner/internal/shim/docker.go`, `getSSHShellCommands`, issue #1769).
    /// Runs the script in a real `sh` with a fake `apt-get` and runner.
    #[test]
    fn sshd_install_runs_without_preloads_and_the_runner_with_them() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        fs_err::create_dir(&bin).unwrap();
        let out = dir.path().join("out");
        let write = |name: &str, body: &str| {
            use std::os::unix::fs::PermissionsExt as _;
            let p = bin.join(name);
            fs_err::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            fs_err::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        write(
            "apt-get",
            &format!(
                "echo \"apt $1 [$LD_PRELOAD] [$LD_LIBRARY_PATH]\" >> {}",
                out.display()
            ),
        );
        let runner = write(
            "runner",
            &format!(
                "echo \"runner [$LD_PRELOAD] [$LD_LIBRARY_PATH] $*\" >> {}",
                out.display()
            ),
        );
        let script = runner_script(&inputs().runner)
            .replace(RUNNER_BINARY_IN_CONTAINER, &runner.display().to_string());
        let status = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(&script)
            .env_clear()
            // No sshd on this PATH, nor in /usr/sbin of a test machine we can rely on: only
            // run the check when /usr/sbin/sshd is absent.
            .env("PATH", &bin)
            .env("LD_PRELOAD", "libfake.so")
            .env("LD_LIBRARY_PATH", "/opt/lib")
            .status()
            .unwrap();
        assert!(status.success());
        let log = fs_err::read_to_string(&out).unwrap();
        if !std::path::Path::new("/usr/sbin/sshd").exists() {
            assert!(log.contains("apt update [] []"), "{log}");
            assert!(log.contains("apt install [] []"), "{log}");
        }
        assert!(
            log.contains("runner [libfake.so] [/opt/lib] --log-level 4 start"),
            "{log}"
        );
    }

    #[test]
    fn script_without_localhost_in_bridge() {
        let mut runner = inputs().runner;
        runner.http_address_localhost = false;
        let script = runner_script(&runner);
        assert!(!script.contains("--http-address"));
        assert!(!script.contains("--ssh-authorized-key"));
        assert!(!script.contains("--ssh-log-level"));
    }

    #[test]
    fn base_spec() {
        let mut i = inputs();
        i.env = vec![("HTTP_PROXY".to_owned(), "http://p:3128".to_owned())];
        i.pjrt_device = Some("TPU".to_owned());
        i.mounts = vec![BindMount {
            source: PathBuf::from("/mnt/disks/dstack-volumes/data"),
            target: "/data".to_owned(),
            read_only: false,
        }];
        i.nano_cpus = nano_cpus(1.5);
        i.memory = 1 << 30;
        i.user = "root".to_owned();
        let spec = build_container_spec(&i);
        assert_eq!(spec.entrypoint, ["/bin/sh", "-c"]);
        assert_eq!(spec.cmd.len(), 1);
        assert_eq!(spec.nano_cpus, 1_500_000_000);
        assert_eq!(spec.memory, 1 << 30);
        assert_eq!(spec.user, "root");
        assert_eq!(
            spec.env,
            [
                ("HTTP_PROXY".to_owned(), "http://p:3128".to_owned()),
                ("PJRT_DEVICE".to_owned(), "TPU".to_owned())
            ]
        );
        let targets: Vec<_> = spec.mounts.iter().map(|m| m.target.as_str()).collect();
        assert_eq!(
            targets,
            ["/tmp/runner", "/usr/local/bin/dstack-runner", "/data"]
        );
        assert!(spec.mounts[1].read_only);
        assert!(!spec.mounts[0].read_only);
        assert_eq!(spec.mounts[0].source, i.runner.dir_host_path);
        assert_eq!(spec.network, NetworkMode::Host);
        assert!(spec.published_ports.is_empty());
        assert_eq!(spec.shm_size, None);
        assert!(spec.tmpfs.is_empty());
        assert!(spec.devices.is_empty() && spec.device_requests.is_empty());
        assert!(spec.ulimits.is_empty());
        assert_eq!(spec.labels, i.labels);
        assert_eq!(
            spec.log, None,
            "no limits asked: the daemon's log configuration"
        );
    }

    #[test]
    fn log_limits_reach_the_spec() {
        let limits = LogLimits::new(
            NonZeroU64::new(100 << 20).unwrap(),
            NonZeroU32::new(3).unwrap(),
        );
        let mut i = inputs();
        i.log = Some(limits);
        let spec = build_container_spec(&i);
        assert_eq!(spec.log, Some(limits));
        assert_eq!(limits.total_bytes(), 300 << 20);
        assert_eq!(
            limits.options(),
            [
                ("max-size", "104857600".to_owned()),
                ("max-file", "3".to_owned())
            ]
        );
        assert_eq!(
            limits.to_string(),
            "json-file max-size=104857600 max-file=3"
        );
        let huge = LogLimits::new(NonZeroU64::MAX, NonZeroU32::MAX);
        assert_eq!(huge.total_bytes(), u64::MAX);
    }

    #[test]
    fn shm_and_bridge() {
        let mut i = inputs();
        i.shm_size = 256 << 20;
        i.network = NetworkMode::Bridge;
        let spec = build_container_spec(&i);
        assert_eq!(spec.shm_size, Some(256 << 20));
        assert_eq!(spec.tmpfs["/dev/shm"], "exec,size=268435456");
        assert_eq!(spec.published_ports, [10999, 10022]);
    }

    #[test]
    fn nano_cpus_conversion() {
        assert_eq!(nano_cpus(0.0), 0);
        assert_eq!(nano_cpus(-1.0), 0);
        assert_eq!(nano_cpus(f64::NAN), 0);
        assert_eq!(nano_cpus(2.0), 2_000_000_000);
        assert_eq!(nano_cpus(0.1), 100_000_000);
    }

    #[test]
    fn nvidia() {
        let mut i = inputs();
        i.gpu = GpuConfig::Nvidia {
            uuids: vec!["GPU-a".to_owned(), "GPU-b".to_owned()],
        };
        let spec = build_container_spec(&i);
        assert_eq!(
            spec.device_requests,
            [DeviceRequest {
                driver: "nvidia".to_owned(),
                device_ids: vec!["GPU-a".to_owned(), "GPU-b".to_owned()],
                capabilities: NVIDIA_CAPABILITIES
                    .iter()
                    .map(|c| (*c).to_owned())
                    .collect(),
            }]
        );
        assert!(without_nvidia_display(&spec, "some other error").is_none());
        let retry = without_nvidia_display(
            &spec,
            "error gathering device information while adding custom device \"/dev/nvidia-modeset\": no such file or directory",
        )
        .unwrap();
        assert_eq!(
            retry.device_requests[0].capabilities,
            ["gpu", "utility", "compute", "graphics", "video", "compat32"]
        );
        // Only once: the retried spec has no display capability left.
        assert!(without_nvidia_display(&retry, "/dev/nvidia-modeset").is_none());
        // Nothing to drop without GPUs.
        assert!(
            without_nvidia_display(&build_container_spec(&inputs()), "/dev/nvidia-modeset")
                .is_none()
        );
    }

    /// CDI: one request of driver `cdi` naming the devices, no capabilities, nothing else
    /// (the spec's edits are the engine's to apply); no display retry applies.
    #[test]
    fn cdi_devices_are_one_request() {
        let mut i = inputs();
        i.gpu = GpuConfig::Cdi {
            devices: vec![
                "nvidia.com/gpu=GPU-a".to_owned(),
                "nvidia.com/gpu=1".to_owned(),
            ],
            amd: false,
        };
        let spec = build_container_spec(&i);
        assert_eq!(
            spec.device_requests,
            [DeviceRequest {
                driver: "cdi".to_owned(),
                device_ids: vec![
                    "nvidia.com/gpu=GPU-a".to_owned(),
                    "nvidia.com/gpu=1".to_owned()
                ],
                capabilities: vec![],
            }]
        );
        assert!(spec.devices.is_empty() && spec.cap_add.is_empty() && spec.ipc_mode.is_none());
        assert!(without_nvidia_display(&spec, "/dev/nvidia-modeset").is_none());
        i.gpu = GpuConfig::Cdi {
            devices: vec![],
            amd: false,
        };
        assert!(build_container_spec(&i).device_requests.is_empty());
    }

    /// AMD's GPUs by CDI get what upstream gives AMD GPUs besides the devices (a CDI spec
    /// cannot carry them): the host's IPC namespace, `SYS_PTRACE`, seccomp unconfined.
    /// upstream: runner/internal/shim/docker.go (configureGpus, GpuVendorAmd).
    #[test]
    fn amd_cdi_devices_keep_amds_process_settings() {
        let mut i = inputs();
        i.gpu = GpuConfig::Cdi {
            devices: vec!["amd.com/gpu=0".to_owned()],
            amd: true,
        };
        let spec = build_container_spec(&i);
        assert_eq!(spec.device_requests.len(), 1);
        assert!(spec.devices.is_empty(), "the spec's to apply");
        assert_eq!(spec.ipc_mode.as_deref(), Some("host"));
        assert_eq!(spec.cap_add, ["SYS_PTRACE"]);
        assert_eq!(spec.security_opt, ["seccomp=unconfined"]);
    }

    #[test]
    fn nvidia_without_uuids_requests_nothing() {
        let mut i = inputs();
        i.gpu = GpuConfig::Nvidia { uuids: vec![] };
        assert!(build_container_spec(&i).device_requests.is_empty());
    }

    #[test]
    fn amd() {
        let mut i = inputs();
        i.gpu = GpuConfig::Amd {
            render_nodes: vec!["/dev/dri/renderD128".to_owned()],
        };
        let spec = build_container_spec(&i);
        assert_eq!(
            spec.devices,
            [
                DeviceMapping::same_path("/dev/kfd"),
                DeviceMapping::same_path("/dev/dri/renderD128")
            ]
        );
        assert_eq!(spec.ipc_mode.as_deref(), Some("host"));
        assert_eq!(spec.cap_add, ["SYS_PTRACE"]);
        assert_eq!(spec.security_opt, ["seccomp=unconfined"]);
    }

    #[test]
    fn tenstorrent_with_and_without_hugepages() {
        let mut i = inputs();
        i.gpu = GpuConfig::Tenstorrent {
            ids: vec!["0".to_owned(), "1".to_owned()],
        };
        let spec = build_container_spec(&i);
        assert_eq!(
            spec.devices,
            [
                DeviceMapping::same_path("/dev/tenstorrent/0"),
                DeviceMapping::same_path("/dev/tenstorrent/1")
            ]
        );
        assert!(!spec.mounts.iter().any(|m| m.target == HUGEPAGES_1G_PATH));
        i.host.hugepages_1g = true;
        let spec = build_container_spec(&i);
        assert!(
            spec.mounts
                .iter()
                .any(|m| m.target == HUGEPAGES_1G_PATH && m.source == Path::new(HUGEPAGES_1G_PATH))
        );
    }

    #[test]
    fn intel() {
        let mut i = inputs();
        i.gpu = GpuConfig::Intel {
            ids: vec!["0".to_owned(), "3".to_owned()],
        };
        let spec = build_container_spec(&i);
        assert_eq!(spec.runtime.as_deref(), Some("habana"));
        assert_eq!(spec.ipc_mode.as_deref(), Some("host"));
        assert_eq!(spec.cap_add, ["SYS_NICE"]);
        assert!(
            spec.env
                .contains(&("HABANA_VISIBLE_DEVICES".to_owned(), "0,3".to_owned()))
        );
    }

    #[test]
    fn plain_devices_replace_vendor_logic() {
        let mut i = inputs();
        let dev = DeviceMapping {
            path_on_host: "/dev/accel0".to_owned(),
            path_in_container: "/dev/accel/0".to_owned(),
            cgroup_permissions: "rwm".to_owned(),
        };
        i.gpu = GpuConfig::Devices(vec![dev.clone()]);
        let spec = build_container_spec(&i);
        assert_eq!(spec.devices, [dev]);
        assert!(spec.device_requests.is_empty());
        assert!(spec.runtime.is_none() && spec.ipc_mode.is_none() && spec.cap_add.is_empty());
    }

    #[test]
    fn infiniband() {
        let mut i = inputs();
        i.host.infiniband = true;
        let spec = build_container_spec(&i);
        assert_eq!(spec.devices, [DeviceMapping::same_path("/dev/infiniband")]);
        assert_eq!(
            spec.ulimits,
            [Ulimit {
                name: "memlock".to_owned(),
                soft: -1,
                hard: -1
            }]
        );
    }
}
