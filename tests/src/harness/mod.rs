//! The one test harness of the workspace, used by the end-to-end tests, the binary's tests and
//! `xtask` (demo, bench, dev-env):
//!
//! - [`http`]: a blocking HTTP/1.1 client (TCP or Unix socket, `Content-Length` and chunked
//!   bodies both ways, bounded connects and reads) and [`Api`], the shim's JSON API with
//!   status checks;
//! - [`process`]: building `dstack-shim`, [`free_port`], [`open_log`], and [`ShimProcess`],
//!   a guard that starts the binary on a home and port, waits until it listens or answers,
//!   sends SIGTERM or SIGKILL, reads its RSS and kills it when dropped;
//! - [`docker`](mod@docker): the `docker` CLI, the owner identity of a home, and [`ContainerSweeper`],
//!   which force-removes a home's (or a label's) containers however a run ends;
//! - [`layout`]: where a task's files are on the host ([`runner_dir`], [`task_dir`]).
//!
//! Errors are `std::io::Error`s whose message names the request, process or file.

pub mod docker;
pub mod http;
pub mod layout;
pub mod process;

pub use docker::{
    ContainerSweeper, LABEL_OWNER, container_exists, containers_labelled, docker, docker_ok,
    owner_identity, try_docker, try_docker_within,
};
pub use http::{Api, Request, Response, status_of};
pub use layout::{runner_dir, task_dir, tasks_dir, write_runner_exit};
pub use process::{
    ShimProcess, build_shim, cargo, free_port, open_log, scrub_cargo_env, shim_binary, tail,
    target_dir,
};
