//! The pure core of the shim: task types and the decisions about them.
//!
//! This crate does no IO, has no async runtime and no clock of its own (time is an argument):
//! the engine feeds it events and carries out the actions it returns. That makes every
//! decision testable by property tests over random event sequences (`tests/`), including a
//! crash of the shim at any point followed by [`restore()`].
//!
//! - [`ids`]: validated task ids and names (they become directory and container names).
//! - [`status`]: statuses and termination reasons as they appear on the wire.
//! - [`config`]: the submit body with defaults and validation.
//! - [`ssh`]: OpenSSH public key validation and SHA256 fingerprints.
//! - [`info`]: the API's task view and the record of acquired resources.
//! - [`record`]: the persisted part of a task.
//! - [`naming`]: the container name of a task.
//! - [`machine`]: the task state machine ([`step`]: [`Event`] in, [`Transition`] out).
//! - [`restore`](mod@restore): what a task is after a restart ([`restore()`]).
//!
//! # The state machine
//!
//! ```text
//!  submit ──> pending ──StartBegan──> preparing ──(GPUs, host keys, volumes, dirs)──┐
//!                                                                                   v
//!             running <──ContainerStarted── creating <──PullDone/PullSkipped── pulling
//!                │                                                                  
//!                │ Observed(Exited/NeverStarted/Missing) ─> terminated (reason per SPEC §2)
//!                │ TerminateRequested ─> terminated + StopContainer{timeout}
//!                v
//!  every status ──(failure of a start step / terminate)──> terminated   (final)
//!
//!  terminated: absorbs every event (first reason and message kept); resources are recorded
//!  as they are acquired and released (Action::Release) only when
//!      terminated ∧ holds something ∧ ¬start_in_flight ∧ no stop in flight ∧ no release out
//!      ∧ the last stop (if any) succeeded — a failed stop is retried (StopContainer{0}) by
//!      the reconciler's next ReleaseRequested, or cleared when it sees the container stopped;
//!  Released removes what was freed, `released = true` once nothing is held; what is left
//!  (ReleaseFailed, partial Released) is retried on the reconciler's next cycle.
//!  RemoveRequested (terminated, start returned) ─> RemoveContainer, Release?, DeleteTaskDir,
//!  Forget.
//! ```
//!
//! Start is a chain of actions: each action the machine emits is carried out by the engine,
//! whose outcome comes back as the next event, and the machine emits the next step:
//! `AcquireGpus → AddHostKeys (if keys) → MountVolume ×n → CreateDir ×m → Pull → CreateContainer
//! → StartContainer → FinishStart`; the start job then steps `StartFinished`. A terminate during
//! start terminates at once (pull: `CancelPull` at once) and start stops at its next step; a
//! container started by the step in progress is stopped (`StopContainer{0}`). Every step that
//! changes the record returns [`Action::Persist`] first.
//!
//! Failures of start map to reasons as in SPEC §2: preparing → `executor_error`; pull or
//! create → `creating_container_error`; start → `container_exited_with_error`.
//!
//! # Restore
//!
//! ```text
//!  record \ container │ present                               │ absent
//!  ───────────────────┼───────────────────────────────────────┼──────────────────────────────
//!  reason recorded    │ terminated (kept); running → Stop{0}  │ terminated (kept); release
//!  no reason          │ running (reconciler decides); LockGpus │ terminated executor_error
//!                     │                                        │ "...never created"/"vanished"
//!  no record          │ running, config None, volumes from     │ nothing
//!                     │ mounts, no SSH keys; LockGpus          │
//! ```
//! GPUs are locked again for every restored task whose resources are not released.

pub mod config;
pub mod ids;
pub mod info;
pub mod machine;
pub mod naming;
pub mod record;
pub mod restore;
pub mod ssh;
pub mod status;

pub use config::{
    ConfigError, GpuDevice, InstanceMountPoint, NetworkMode, Secret, TaskConfig, VolumeBackend,
    VolumeMountPoint, VolumeSpec,
};
pub use ids::{InvalidId, TaskId, TaskName};
pub use info::{HostKeysGrant, MountedVolume, PortMapping, PullProgress, Resources, TaskInfo};
pub use machine::{
    Action, Event, Observation, StartStep, StopState, Task, Transition, TransitionError, step,
};
pub use naming::container_name;
pub use record::TaskRecord;
pub use restore::{ContainerState, ObservedContainer, restore};
pub use ssh::{InvalidKey, PublicKey};
pub use status::{TaskStatus, TerminationReason};
