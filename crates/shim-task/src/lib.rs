//! The pure core of the shim: task types and the decisions about them.
//!
//! This crate does no IO, has no async runtime and no clock of its own (time is an argument):
//! the engine feeds it events and carries out the actions it returns. That makes every
//! decision testable by property tests over random event sequences (`tests/`), including a
//! crash of the shim at any point followed by [`restore()`].
//!
//! - Ids ([`TaskId`], [`TaskName`]): validated task ids and names (they become directory and
//!   container names).
//! - [`TaskStatus`], [`TerminationReason`]: statuses and termination reasons as on the wire.
//! - [`TaskConfig`]: the submit body with defaults and validation.
//! - [`PublicKey`]: OpenSSH public key validation and SHA256 fingerprints.
//! - [`TaskInfo`], [`Resources`]: the API's task view and the record of acquired resources.
//! - [`TaskRecord`]: the persisted part of a task.
//! - [`naming`]: the container name of a task.
//! - [`machine`]: the task state machine ([`machine::step`]: [`machine::Event`] in,
//!   [`machine::Transition`] out).
//! - [`restore()`]: what a task is after a restart.
//!
//! Every item has one path: the crate root, or the public module [`machine`] or [`naming`].
//!
//! # The state machine
//!
//! ```text
//!            StartBegan     GpusAcquired → [HostKeysAdded] → (VolumeMounting, VolumeMounted)×n
//!  pending ─────────────> preparing ─── → DirCreated/DirExisted×m ───┐
//!                                                                    v
//!  running <──ContainerStarted── creating <──PullDone/PullSkipped── pulling
//!     │          (ContainerCreated keeps creating)
//!     │ Observed(Exited 0)           ─> terminated done_by_runner, ""
//!     │ Observed(Exited n≠0)         ─> terminated container_exited_with_error, last 5 lines
//!     │ Observed(NeverStarted/Missing) ─> terminated executor_error, says so
//!     │ TerminateRequested           ─> terminated (request's reason) + StopContainer{timeout}
//!     v
//!  terminated  (final; also reached from every status by a start failure or a terminate)
//!
//!  start failures: PrepareFailed → executor_error; PullFailed, CreateFailed, StartRefused
//!  (the engine refused the container's devices) → creating_container_error; StartFailed →
//!  container_exited_with_error; StartAborted, or StartFinished before running →
//!  executor_error.
//! ```
//!
//! - `terminated` absorbs every event: the first reason and message are kept.
//! - Resources are recorded in `record.resources` as they are acquired (host keys just before
//!   the add, volumes just before the mount: [`Event::VolumeMounting`](machine::Event::VolumeMounting)), and [`Effect::Release`](machine::Effect::Release) is emitted only when the task is terminated, holds
//!   something, start is not in flight, no stop is in flight, the last stop (if any)
//!   succeeded, and no release is out. A failed stop is retried (`StopContainer{0}`) on the
//!   reconciler's next [`Event::ReleaseRequested`](machine::Event::ReleaseRequested), or cleared when it sees the container not
//!   running. [`Event::Released`](machine::Event::Released) removes what was freed; `released = true` once nothing is
//!   held; what is left is retried on the reconciler's next cycle ([`Task::needs_release`](machine::Task::needs_release)).
//! - [`Event::RemoveRequested`](machine::Event::RemoveRequested) (terminated, start returned, no release out) →
//!   `RemoveContainer, Release (if held), DeleteTaskDir, Forget`; anything else is a
//!   [`TransitionError`](machine::TransitionError).
//!
//! Start is a chain of actions: each action the machine emits is carried out by the engine,
//! whose outcome comes back as the next event, and the machine emits the next step:
//! `AcquireGpus → AddHostKeys (if keys) → MountVolume ×n → CreateDir ×m → Pull → CreateContainer
//! → StartContainer → FinishStart`; the start job then steps `StartFinished`. A terminate during
//! start terminates at once (pull: `CancelPull` at once) and start stops at its next step; a
//! container started by the step in progress is stopped (`StopContainer{0}`). Every step that
//! changes the record returns [`Action::Persist`](machine::Action::Persist) first. See [`machine`] for what the engine
//! must do.
//!
//! # Restore
//!
//! ```text
//!  record \ container │ present                                │ absent
//!  ───────────────────┼────────────────────────────────────────┼─────────────────────────────
//!  reason recorded    │ terminated (kept); running → Stop{0};  │ terminated (kept); release
//!                     │ release once stopped                   │
//!  no reason          │ running (the reconciler decides); ids, │ terminated executor_error:
//!                     │ ports, GPU ids from the container      │ "…no container…found" / "…vanished"
//!  no record          │ running, config None, volumes from its │ nothing
//!                     │ mounts, no SSH keys                    │
//! ```
//! GPUs are locked again (`LockGpus`) for every restored task whose resources are not
//! released; the engine carries restore's actions out before the reconciler's first cycle.

mod config;
mod ids;
mod info;
pub mod machine;
pub mod naming;
mod record;
mod restore;
mod ssh;
mod status;

pub use config::{
    ConfigError, GpuDevice, InstanceMountPoint, KeyLine, NetworkMode, Secret, TaskConfig,
    VolumeBackend, VolumeMountPoint, VolumeSpec,
};
pub use ids::{InvalidId, TaskId, TaskName};
pub use info::{
    HostKeysGrant, MountedVolume, PortMapping, PullProgress, Resources, TaskInfo, UnknownKeys,
};
pub use record::TaskRecord;
pub use restore::{ObservedContainer, ObservedState, restore};
pub use ssh::{InvalidKey, PublicKey};
pub use status::{TaskStatus, TerminationReason};

/// The code in this crate's README, compiled as a doctest so it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
