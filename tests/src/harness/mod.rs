//! The one test harness of the workspace, used by the end-to-end tests, the binary's tests and
//! `xtask` (demo, bench, dev-env):
//!
//! - [`host`]: what a test makes of the host as root: [`LoopFs`] (a small file system on a
//!   loop device) and [`PrivateDocker`] (a Docker daemon of its own);
//! - [`http`]: a blocking HTTP/1.1 client (TCP or Unix socket, `Content-Length` and chunked
//!   bodies both ways, answers read whole or streamed, bounded connects and reads) and
//!   [`Api`], the shim's JSON API with status checks;
//! - [`process`]: building `dstack-shim` and the static test runner ([`build_test_runner`]),
//!   [`free_port`], [`open_log`], [`prefixed`] (a command run under a wrapper), and
//!   [`ShimProcess`], a guard that starts the binary on a
//!   home and port, waits until it listens or answers, sends SIGTERM or SIGKILL, reads its RSS
//!   and kills it when dropped;
//! - [`procs`]: the host's processes found by name ([`procs::find`], the `dockerd` of the
//!   default socket) and a command's line and output, for `xtask` and the bench;
//! - [`artifact`]: the release artifact `cargo xtask dist` lays out and the checks CI makes
//!   of it (glibc symbol versions, stripped, checksum, version line);
//! - [`gpu_host`]: [`FakeGpuHost`], a fake GPU host (`tests/gpu-host/fake_gpu_host.py`:
//!   fake device nodes, the vendor's tool in its real formats, a CDI spec) and the prefix under
//!   which the shim sees it as a real one; [`run_with_cdi_devices`], a container given CDI
//!   devices as the shim asks for them;
//! - [`docker`](mod@docker): the `docker` CLI, the owner identity of a home, and [`ContainerSweeper`],
//!   which force-removes a home's (or a label's) containers however a run ends;
//! - [`layout`]: where a task's files are on the host ([`runner_dir`], [`task_dir`]), and
//!   [`entries`] of a directory;
//! - [`metrics`](mod@metrics): [`Metrics`], `GET /metrics` read by a strict OpenMetrics parser
//!   ([`TestShim::metrics`]);
//! - [`proxy`]: [`LosingProxy`], a proxy on a Unix socket in front of Docker's that loses the
//!   answers to chosen requests (the daemon did the work; the answer never came);
//! - [`registry`](mod@registry): [`Registry`], the test registry's HTTP API spoken directly
//!   (manifests, blobs, cross-repository mounts), and [`Layer`], so a test puts an image there
//!   that no Docker daemon ever held ([`Registry::push_with_layer`]); [`SlowProxy`], a
//!   registry's answers at a bounded rate (so the containerd store reports a pull's bytes);
//!   and [`FreshImage`], both at once: an image of fresh random content that every engine
//!   really downloads, slowly, removed from the registry and the daemon when dropped;
//! - [`shim`]: [`TestShim`], one test's shim under test (a home, the process across
//!   restarts, its logs, its API with the checks the tests make, its containers) and its
//!   clean-up;
//! - [`sse`]: [`SseParser`], the one parser of the shim's Server-Sent Events (tests and bench),
//!   and [`EventStream`], the tests' client of them;
//! - [`supervisor`](mod@supervisor): [`Supervisor`], which runs a command as systemd runs the
//!   shim's unit (restarted after a delay when it exits, its process group stopped first);
//! - [`task`]: task configs as the server sends them, container names, fake GPU ids, SSH
//!   keys;
//! - [`user`]: [`HostUser`], a host user of one test with an `authorized_keys`;
//! - [`wait`]: bounded waits that fail the test ([`wait_for`], [`wait_until`]).
//!
//! Errors are `std::io::Error`s whose message names the request, process or file; the
//! helpers made only for tests ([`TestShim`], [`HostUser`], [`wait_for`], [`docker_ok`], the
//! checks of a [`Response`]) panic instead, failing the test with what was wrong.

pub mod artifact;
pub mod docker;
pub mod gpu_host;
pub mod host;
pub mod http;
pub mod layout;
pub mod metrics;
pub mod process;
pub mod procs;
pub mod proxy;
pub mod registry;
pub mod shim;
pub mod sse;
pub mod supervisor;
pub mod task;
pub mod user;
pub mod wait;

pub use docker::{
    ContainerSweeper, LABEL_OWNER, NamedContainer, RemoveImage, container_exists,
    container_running, containers_labelled, docker, docker_at, docker_at_ok, docker_ok,
    owner_identity, try_docker, try_docker_within, wait_container_stopped,
};
pub use gpu_host::{
    CdiName, ContainerRun, FakeGpuHost, FakeGpuHostOptions, FakeHealth, FakeVendor,
    run_with_cdi_devices,
};
pub use host::{LoopFs, PrivateDocker, fs_usage, images_at, take};
pub use http::{Api, Body, Request, Response, Streamed, status_of};
pub use layout::{
    SPARE_PREFIX, entries, runner_dir, stage_runner_exit, task_dir, task_entries, tasks_dir,
    write_runner_exit,
};
pub use metrics::{Metrics, parse_openmetrics};
pub use process::{
    ShimProcess, build_shim, build_test_runner, cargo, free_port, open_log, prefixed,
    scrub_cargo_env, shim_binary, shim_command, tail, target_dir,
};
pub use proxy::{LosingProxy, docker_socket};
pub use registry::{FreshImage, Layer, Registry, SlowProxy};
pub use shim::{
    FAKE_GPUS, RUNNER_HTTP_PORT, RUNNER_SSH_PORT, TestShim, TestShimBuilder, WAIT_BOUND,
};
pub use sse::{EventStream, SseEvent, SseParser, parse_block};
pub use supervisor::Supervisor;
pub use task::{
    KEY_MARKER, assert_running, bridge_task, container_name, container_name_of, fake_gpu_ids,
    pending_info, published_ports, run_tag, server_task, ssh_key,
};
pub use user::{HostUser, append_key_line};
pub use wait::{wait_for, wait_until};
