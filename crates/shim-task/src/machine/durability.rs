//! What a change means for the state file: a write first (alone), start progress that the
//! next write carries, or nothing; and the side effects that may then go out.

use std::sync::Arc;

use super::due::{due, settle_released};
use super::event::Action;
use super::task::Task;
use crate::config::TaskConfig;
use crate::record::TaskRecord;
use crate::status::TaskStatus;

/// How a step's event shapes the actions beyond its own.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    /// A write that the record needs goes out now even if this event did not change it (a
    /// request or the reconciler finding a dirty record).
    pub(super) retry_write: bool,
    /// No write may be emitted (the event is a write's failure: the retry waits).
    pub(super) no_write: bool,
}

pub(super) const PLAIN: Shape = Shape {
    retry_write: false,
    no_write: false,
};

/// Whether two records hold the same config: the same allocation (a step's `before` is a clone
/// of the record, which shares it), or equal ones.
fn same_config(old: Option<&Arc<TaskConfig>>, new: Option<&Arc<TaskConfig>>) -> bool {
    match (old, new) {
        (Some(old), Some(new)) => Arc::ptr_eq(old, new) || old == new,
        (None, None) => true,
        _ => false,
    }
}

/// Whether two records differ in more than their update time. Exhaustive by construction: a
/// new field of [`TaskRecord`] is a compile error here until it is compared.
pub(crate) fn record_changed(old: &TaskRecord, new: &TaskRecord) -> bool {
    let TaskRecord {
        id,
        name,
        container_name,
        config,
        status,
        termination_reason,
        termination_message,
        container_id,
        resources,
        created_at_ms,
        updated_at_ms: _,
    } = old;
    *id != new.id
        || *name != new.name
        || *container_name != new.container_name
        || !same_config(config.as_ref(), new.config.as_ref())
        || *status != new.status
        || *termination_reason != new.termination_reason
        || *termination_message != new.termination_message
        || *container_id != new.container_id
        || *resources != new.resources
        || *created_at_ms != new.created_at_ms
}

/// Whether `new` differs from `old` only by start progress: the status advanced to a start
/// status (`preparing`, `pulling`, `creating`) or, while the container `runs`, to `running`;
/// or the first container id arrived during one. A restart reads all of it from the
/// container (SPEC §5: a record without a reason and a container is `running`, with that
/// container's id), so none of it needs a write of its own.
fn is_progress(old: &TaskRecord, new: &TaskRecord, runs: bool) -> bool {
    let start_status = |s: TaskStatus| match s {
        TaskStatus::Preparing | TaskStatus::Pulling | TaskStatus::Creating => true,
        TaskStatus::Running => runs,
        _ => false,
    };
    let advanced = new.status > old.status;
    let first_container = old.container_id.is_none() && new.container_id.is_some();
    (advanced || first_container)
        && new.status >= old.status
        && start_status(new.status)
        && !record_changed(
            old,
            &TaskRecord {
                status: old.status,
                // Only the first container id is progress; another one is a change.
                container_id: if first_container {
                    None
                } else {
                    new.container_id.clone()
                },
                ..new.clone()
            },
        )
}

/// Finishes a transition: a changed (or, when asked, a dirty) record is written first and
/// alone, unless all that is not yet written is start progress ([`Task::is_progress_only`])
/// and `may_defer` (a start in flight, or a restore); otherwise the side effects due go out.
pub(super) fn finish(
    before: &TaskRecord,
    t: &mut Task,
    actions: &mut Vec<Action>,
    shape: Shape,
    now_ms: u64,
    may_defer: bool,
) {
    settle_released(t);
    let changed = record_changed(before, &t.record);
    if changed {
        t.record.updated_at_ms = now_ms.max(before.updated_at_ms);
        // Start progress stays progress only while nothing else waits to be written.
        t.progress_only = may_defer
            && (!t.dirty || t.progress_only)
            && is_progress(before, &t.record, t.container_runs());
        t.dirty = true;
    }
    let write = t.dirty && !shape.no_write && ((changed && !t.progress_only) || shape.retry_write);
    if write {
        // Only actions that need no durable record may follow the write (GPU relocks at
        // restore); the side effects wait for `Persisted`.
        debug_assert!(actions.iter().all(|a| !a.needs_durable_record()));
        actions.insert(0, Action::Persist);
    } else {
        due(t, actions);
    }
}

/// Finishes the transition of a restored task: `before` is the record read from disk, or
/// `None` when there was none (the task is written either way).
pub(crate) fn finish_restore(
    before: Option<&TaskRecord>,
    t: &mut Task,
    actions: &mut Vec<Action>,
    now_ms: u64,
) {
    let shape = match before {
        Some(_) => PLAIN,
        None => {
            t.dirty = true;
            Shape {
                retry_write: true,
                no_write: false,
            }
        }
    };
    // A record the container proves `running` (its start progress unwritten before the
    // restart) stays as it is: the next restart reads the same from the container.
    let may_defer = before.is_some();
    let before = before.cloned().unwrap_or_else(|| t.record.clone());
    finish(&before, t, actions, shape, now_ms, may_defer);
}
