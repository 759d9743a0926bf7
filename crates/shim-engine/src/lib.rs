//! The shim engine: submit, start, terminate, remove, reconcile and restore tasks.
//!
//! The engine is the only place where side effects are sequenced. The pure state machine of
//! [`shim_task::machine`] decides; the engine steps it with an event, carries out the returned
//! actions in order against the container runtime ([`shim_runtime`]), the host resources
//! ([`shim_resources`]) and the task store ([`shim_store`]), and feeds each action's outcome
//! back as the next event. Every record change is persisted before the next side effect.
//!
//! - [`Engine::submit`] writes the task's state file, then launches start in the background;
//!   start returns as soon as the container runs.
//! - A background reconciler, driven by Docker's `die`/`oom`/`destroy` events, completes tasks
//!   whose containers ended and releases what terminated tasks hold; a full container list
//!   runs at start-up, on every reconnection of the event stream and as a slow backstop
//!   (minutes), and a one-second pass in memory retries failed writes, stops and releases.
//! - [`Engine::open`] restores every task of this shim from its state files and its
//!   containers (those whose runner directory lies in its home: [`labels`]) and runs the first
//!   reconcile cycle before it returns, so an HTTP server started afterwards never serves a
//!   stale view.
//!
//! What an agent built on it needs besides the operations: [`Engine::subscribe`] (every task
//! change, in order), [`Engine::health`] (readiness with its reasons), [`EngineError::kind`]
//! (how an API answers each error), [`Engine::register_metrics`] (the engine's metrics in the
//! agent's Prometheus registry), and [`Engine::shutdown`]. Dropping the last [`Engine`] handle
//! stops the background jobs without waiting for them; containers keep running either way.
//!
//! # Embedding
//!
//! ```no_run
//! use std::sync::Arc;
//! use shim_engine::{Deps, Engine, EngineConfig};
//! use shim_resources::{AuthorizedKeysManager, BlockVolumes, GpuDetector, VolumeConfig};
//! use shim_util::SystemCommandRunner;
//! use shim_runtime::DockerRuntime;
//! use shim_task::{TaskConfig, TaskId, TaskName};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let commands = Arc::new(SystemCommandRunner::default());
//! let mut deps = Deps::new(
//!     Arc::new(DockerRuntime::connect().await?),
//!     Arc::new(AuthorizedKeysManager::system()),
//!     Arc::new(BlockVolumes::new(VolumeConfig::default(), commands.clone())),
//! );
//! deps.host_gpus = GpuDetector::new(commands).detect().await;
//! // SPEC's defaults (a five-minute backstop list; Docker's events do the rest).
//! let engine = Engine::open(EngineConfig::new("/var/lib/my-agent"), deps).await?;
//! let config = TaskConfig::new(TaskId::new("t1")?, TaskName::new("job")?, "busybox:1");
//! let info = engine.submit(config).await?;
//! println!("{} is {}", info.id, info.status);
//! # Ok(()) }
//! ```

pub mod changes;
mod clock;
mod config;
mod counters;
mod deps;
mod driver;
mod engine;
mod error;
mod gpus;
mod health;
mod home;
mod images;
pub mod labels;
mod metered;
pub mod metrics;
mod ownership;
mod pulling;
mod queue;
mod reconcile;
mod records;
mod restore;
mod spec;
mod table;
mod usage;

pub use changes::{ChangeKind, Subscription, SubscriptionError, TaskChange};
pub use clock::Clock;
pub use config::{EngineConfig, default_pass_env};
pub use deps::{Deps, HostOptions};
pub use engine::{Engine, Opening, Shutdown};
pub use error::{EngineError, ErrorKind, Result};
pub use gpus::GpuDeviceMode;
pub use health::EngineHealth;
/// The Prometheus client the engine's metrics are built on, for an embedder's registry
/// ([`Engine::register_metrics`]).
pub use prometheus_client;

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
