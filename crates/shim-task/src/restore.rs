//! The restore decision (SPEC §5): a persisted record and an observed container in, the task
//! as it is now and what to do out.

use crate::ids::{TaskId, TaskName};
use crate::info::{MountedVolume, PortMapping, Resources};
use crate::machine::{Action, Effect, Saved, StopState, Task, finish_restore};
use crate::naming::task_name_of_container;
use crate::record::TaskRecord;
use crate::status::{TaskStatus, TerminationReason};

/// A container's state as the restore decision needs it (the engine maps the runtime's
/// `ContainerState` onto it: paused and restarting count as running; an exit with its code).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ObservedState {
    /// Created, never started.
    Created,
    /// Running (or paused, or restarting: the process exists).
    Running,
    /// Exited with this code.
    Exited {
        /// The exit code.
        code: i64,
    },
    /// Dead (removal failed half-way).
    Dead,
    /// Any other state string.
    Other(String),
}

impl ObservedState {
    /// Whether the container's process may be running.
    pub fn is_running(&self) -> bool {
        matches!(self, Self::Running)
    }
}

/// A container of this shim found on restart (by its label).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedContainer {
    /// The container id.
    pub id: String,
    /// The container name (a leading `/` is ignored).
    pub name: String,
    /// The task id from the container's label.
    pub task_id: TaskId,
    /// Its state.
    pub state: ObservedState,
    /// GPU ids from its device requests / devices.
    pub gpu_ids: Vec<String>,
    /// Its published ports (`[]` in host network mode).
    pub ports: Vec<PortMapping>,
    /// Volumes recovered from its mounts (used for containers without a state file).
    pub recovered_volumes: Vec<MountedVolume>,
}

/// Why a task restored without a container ended. A start does not write the id of the
/// container it just created on its own (start progress, see the machine's docs), so a record
/// without one may have had a container that was removed while the shim was down.
fn lost_container_message(record: &TaskRecord) -> String {
    match &record.container_id {
        None => format!(
            "the shim stopped while the task was {}; no container of it was found when the \
             shim restarted (its start was cut short before the container was created, or the \
             container was removed while the shim was down)",
            record.status
        ),
        Some(id) => {
            format!("container vanished: container {id} was not found when the shim restarted")
        }
    }
}

/// A record for a container an older shim made without a state file: no config, no SSH keys
/// (they cannot be recovered), volumes from the container's mounts.
fn adopted_record(c: &ObservedContainer, now_ms: u64) -> Option<TaskRecord> {
    let name = match task_name_of_container(&c.name) {
        Some(name) => name,
        None => TaskName::new(c.task_id.as_str()).ok()?,
    };
    Some(TaskRecord {
        id: c.task_id.clone(),
        name,
        container_name: c.name.strip_prefix('/').unwrap_or(&c.name).to_owned(),
        config: None,
        status: TaskStatus::Running,
        termination_reason: None,
        termination_message: String::new(),
        container_id: Some(c.id.clone()).filter(|id| !id.is_empty()),
        resources: Resources {
            gpus: c.gpu_ids.clone(),
            host_keys: None,
            volumes: c.recovered_volumes.clone(),
            created_dirs: Vec::new(),
            // Whatever host keys it added cannot be named: keep marked lines of unknown origin.
            unknown_keys: Some(crate::info::UnknownKeys { user: None }),
            released: false,
        },
        created_at_ms: now_ms,
        updated_at_ms: now_ms,
    })
}

/// Decides what a task is after a restart of the shim (SPEC §5), from its state file's record
/// (if any) and its container (if any; a container whose task id differs from the record's is
/// ignored). `None` when there is neither.
///
/// - a recorded termination reason wins: `terminated` with it; a still running container is
///   stopped (`StopContainer{0}`); what is not released is released;
/// - no reason, but a container: `running` (the reconciler decides next), with the container
///   id, ports and GPU ids from the container;
/// - a record without a container: `terminated` with `executor_error` saying what happened,
///   and released;
/// - a container without a record (an older shim): a task without config whose volumes were
///   recovered from the container's mounts, no SSH keys.
///
/// GPUs are locked again ([`Effect::LockGpus`], which needs no durable record and which the
/// engine carries out for every task before anything else) for every restored task whose
/// resources are not released. A changed record is written ([`Action::Persist`] first); the
/// stop and the release it calls for go out once it is durable. Restoring the restored task's
/// record with the same container gives the same task and no [`Action::Persist`].
pub fn restore(
    record: Option<TaskRecord>,
    container: Option<ObservedContainer>,
    now_ms: u64,
) -> Option<(Task, Vec<Action>)> {
    let container = match (&record, container) {
        (Some(r), Some(c)) if c.task_id != r.id => None,
        (_, c) => c,
    };
    let (original, record) = match (record, &container) {
        (None, None) => return None,
        (None, Some(c)) => (None, adopted_record(c, now_ms)?),
        (Some(r), _) => (Some(r.clone()), r),
    };
    let saved = Saved::of(original.as_ref().unwrap_or(&record));
    let mut t = Task::restored(record, saved);
    let mut actions = Vec::new();
    // Nothing of the task runs without a container, or with one that does not run now.
    t.ended = container.as_ref().is_none_or(|c| {
        matches!(
            c.state,
            ObservedState::Created | ObservedState::Exited { .. } | ObservedState::Dead
        )
    });
    // A running container proves `running` before the restored record is written.
    t.runs = container.as_ref().is_some_and(|c| c.state.is_running());

    if t.record.termination_reason.is_some() {
        t.record.status = TaskStatus::Terminated;
    } else if container.is_some() {
        if t.record.status == TaskStatus::Terminated {
            // Terminated without a reason cannot be written by this shim; keep it final.
            t.record.termination_reason = Some(TerminationReason::ExecutorError);
        } else {
            t.record.status = TaskStatus::Running;
        }
    } else {
        let message = lost_container_message(&t.record);
        t.record.status = TaskStatus::Terminated;
        t.record.termination_reason = Some(TerminationReason::ExecutorError);
        t.record.termination_message = message;
    }

    if let Some(c) = &container {
        if !c.id.is_empty() {
            t.record.container_id = Some(c.id.clone());
        }
        t.ports = Some(c.ports.clone());
        t.gpu_ids = Some(c.gpu_ids.clone());
        if t.record.status == TaskStatus::Running && !t.record.resources.released {
            // The running container uses these GPUs: hold them.
            for g in &c.gpu_ids {
                if !t.record.resources.gpus.contains(g) {
                    t.record.resources.gpus.push(g.clone());
                }
            }
        }
    } else if !t.record.resources.gpus.is_empty() {
        t.gpu_ids = Some(t.record.resources.gpus.clone());
    }

    if !t.record.resources.released && !t.record.resources.gpus.is_empty() {
        actions.push(Action::Effect(Effect::LockGpus(
            t.record.resources.gpus.clone(),
        )));
    }
    // A container the list shows as created may be starting right now (the shim was killed
    // during its start: a list does not wait for a start in flight, a stop does), so it is
    // stopped too; a stop of a container that never starts changes nothing. Otherwise it
    // would run on with what the terminated task releases.
    if t.record.status == TaskStatus::Terminated
        && container
            .as_ref()
            .is_some_and(|c| c.state.is_running() || c.state == ObservedState::Created)
    {
        t.stop = StopState::Wanted { timeout_s: 0 };
    }
    finish_restore(original.as_ref(), &mut t, &mut actions, now_ms);
    Some((t, actions))
}
