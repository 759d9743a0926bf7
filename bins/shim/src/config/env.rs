//! The environment variables of each flag, read when the flag is not given (upstream's names
//! first, this shim's own old names as aliases after them), and the help text generated from
//! them.

/// The environment variables of each flag, in the order they are read (upstream's first).
pub const ENV: &[(&str, &[&str])] = &[
    ("shim-home", &["DSTACK_SHIM_HOME"]),
    ("shim-binary-path", &["DSTACK_SHIM_BINARY_PATH"]),
    ("shim-http-port", &["DSTACK_SHIM_HTTP_PORT"]),
    ("shim-log-level", &["DSTACK_SHIM_LOG_LEVEL"]),
    ("runner-download-url", &["DSTACK_RUNNER_DOWNLOAD_URL"]),
    ("runner-binary-path", &["DSTACK_RUNNER_BINARY_PATH"]),
    ("runner-http-port", &["DSTACK_RUNNER_HTTP_PORT"]),
    ("runner-ssh-port", &["DSTACK_RUNNER_SSH_PORT"]),
    ("runner-ssh-log-level", &["DSTACK_RUNNER_SSH_LOG_LEVEL"]),
    ("runner-log-level", &["DSTACK_RUNNER_LOG_LEVEL"]),
    (
        "dcgm-exporter-http-port",
        &["DSTACK_DCGM_EXPORTER_HTTP_PORT"],
    ),
    ("dcgm-exporter-interval", &["DSTACK_DCGM_EXPORTER_INTERVAL"]),
    ("dcgm-address", &["DSTACK_DCGM_ADDRESS"]),
    (
        "pass-env",
        &["DSTACK_DOCKER_PASS_ENV", "DSTACK_SHIM_PASS_ENV"],
    ),
    ("privileged", &["DSTACK_DOCKER_PRIVILEGED"]),
    ("pjrt-device", &["PJRT_DEVICE"]),
    ("service", &["DSTACK_SERVICE_MODE"]),
    ("unix-socket", &["DSTACK_SHIM_UNIX_SOCKET"]),
    ("volumes-root", &["DSTACK_SHIM_VOLUMES_ROOT"]),
    ("log-format", &["DSTACK_SHIM_LOG_FORMAT"]),
    ("reconcile-interval", &["DSTACK_SHIM_RECONCILE_INTERVAL"]),
    (
        "container-log-max-size",
        &["DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE"],
    ),
    (
        "container-log-max-files",
        &["DSTACK_SHIM_CONTAINER_LOG_MAX_FILES"],
    ),
    ("pull-stall-timeout", &["DSTACK_SHIM_PULL_STALL_TIMEOUT"]),
    ("pull-timeout", &["DSTACK_SHIM_PULL_TIMEOUT"]),
    (
        "image-gc-high-percent",
        &["DSTACK_SHIM_IMAGE_GC_HIGH_PERCENT"],
    ),
    (
        "image-gc-low-percent",
        &["DSTACK_SHIM_IMAGE_GC_LOW_PERCENT"],
    ),
    ("gpu-device-mode", &["DSTACK_SHIM_GPU_DEVICE_MODE"]),
    ("gpu-health-interval", &["DSTACK_SHIM_GPU_HEALTH_INTERVAL"]),
    (
        "disable-gpu-healthchecks",
        &["DSTACK_SHIM_DISABLE_GPU_HEALTHCHECKS"],
    ),
    ("dcgm-exporter-path", &["DSTACK_DCGM_EXPORTER_PATH"]),
    ("dcgmi-path", &["DSTACK_DCGMI_PATH"]),
    ("nv-hostengine-path", &["DSTACK_NV_HOSTENGINE_PATH"]),
];

/// The environment variables `flag` reads, in order (none for a flag without any).
pub fn names(flag: &str) -> &'static [&'static str] {
    ENV.iter()
        .find(|(f, _)| *f == flag)
        .map_or(&[], |(_, names)| names)
}

/// The help's closing paragraph: every variable of [`ENV`] in the flags' order (aliases in
/// parentheses), and the spellings of a boolean.
pub fn help() -> String {
    let names: Vec<String> = ENV
        .iter()
        .map(|(_, names)| match names {
            [first, aliases @ ..] if !aliases.is_empty() => {
                format!("{first} (or {})", aliases.join(", "))
            }
            _ => names.join(", "),
        })
        .collect();
    format!(
        "Environment variables (read when the flag is not given): {}. Booleans: {}.\n\n\
         The container engine is the Docker API at DOCKER_HOST (default \
         unix:///var/run/docker.sock): Docker 20.10 or newer with either image store, or \
         Podman 4.3 or newer through its Docker-compatible socket \
         (DOCKER_HOST=unix:///run/podman/podman.sock).",
        names.join(", "),
        super::goparse::GO_BOOLS.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated text is the one the help had when it was written by hand.
    #[test]
    fn the_help_names_every_variable() {
        assert_eq!(
            help(),
            "Environment variables (read when the flag is not given): DSTACK_SHIM_HOME, \
             DSTACK_SHIM_BINARY_PATH, DSTACK_SHIM_HTTP_PORT, DSTACK_SHIM_LOG_LEVEL, \
             DSTACK_RUNNER_DOWNLOAD_URL, DSTACK_RUNNER_BINARY_PATH, DSTACK_RUNNER_HTTP_PORT, \
             DSTACK_RUNNER_SSH_PORT, DSTACK_RUNNER_SSH_LOG_LEVEL, DSTACK_RUNNER_LOG_LEVEL, \
             DSTACK_DCGM_EXPORTER_HTTP_PORT, DSTACK_DCGM_EXPORTER_INTERVAL, DSTACK_DCGM_ADDRESS, \
             DSTACK_DOCKER_PASS_ENV (or DSTACK_SHIM_PASS_ENV), DSTACK_DOCKER_PRIVILEGED, \
             PJRT_DEVICE, DSTACK_SERVICE_MODE, DSTACK_SHIM_UNIX_SOCKET, DSTACK_SHIM_VOLUMES_ROOT, \
             DSTACK_SHIM_LOG_FORMAT, DSTACK_SHIM_RECONCILE_INTERVAL, \
             DSTACK_SHIM_CONTAINER_LOG_MAX_SIZE, DSTACK_SHIM_CONTAINER_LOG_MAX_FILES, \
             DSTACK_SHIM_PULL_STALL_TIMEOUT, DSTACK_SHIM_PULL_TIMEOUT, \
             DSTACK_SHIM_IMAGE_GC_HIGH_PERCENT, DSTACK_SHIM_IMAGE_GC_LOW_PERCENT, \
             DSTACK_SHIM_GPU_DEVICE_MODE, DSTACK_SHIM_GPU_HEALTH_INTERVAL, \
             DSTACK_SHIM_DISABLE_GPU_HEALTHCHECKS, DSTACK_DCGM_EXPORTER_PATH, DSTACK_DCGMI_PATH, DSTACK_NV_HOSTENGINE_PATH. Booleans: 1 t T TRUE true True 0 f F \
             FALSE false False.\n\nThe container engine is the Docker API at DOCKER_HOST \
             (default unix:///var/run/docker.sock): Docker 20.10 or newer with either image \
             store, or Podman 4.3 or newer through its Docker-compatible socket \
             (DOCKER_HOST=unix:///run/podman/podman.sock)."
        );
        assert_eq!(
            names("pass-env"),
            ["DSTACK_DOCKER_PASS_ENV", "DSTACK_SHIM_PASS_ENV"]
        );
        assert!(names("fake-gpus").is_empty());
    }
}
