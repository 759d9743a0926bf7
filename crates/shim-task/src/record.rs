//! The persisted part of a task: what the shim must remember across restarts because the
//! container cannot tell it. The store wraps it in a versioned envelope.

use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize};

use crate::config::TaskConfig;
use crate::ids::{TaskId, TaskName};
use crate::info::Resources;
use crate::status::{TaskStatus, TerminationReason};

/// A task as persisted in its `task.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Task id.
    pub id: TaskId,
    /// Task name.
    pub name: TaskName,
    /// The container's name, fixed at submit.
    pub container_name: String,
    /// The config without registry credentials; `None` for a task adopted from a container
    /// that an older shim created without a state file. Shared: a record is cloned at each step
    /// of its task (to tell whether it changed) and the config never changes after the submit.
    pub config: Option<Arc<TaskConfig>>,
    /// Status at the last persisted change.
    pub status: TaskStatus,
    /// Set once terminated; the first reason is kept.
    pub termination_reason: Option<TerminationReason>,
    /// Set with the reason.
    #[serde(default)]
    pub termination_message: String,
    /// The container's id, once one was created (`None` before; the state file writes `""`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_is_none"
    )]
    pub container_id: Option<String>,
    /// What the task holds.
    #[serde(default)]
    pub resources: Resources,
    /// Submit time, Unix milliseconds.
    pub created_at_ms: u64,
    /// Last change, Unix milliseconds.
    pub updated_at_ms: u64,
}

impl TaskRecord {
    /// A new `pending` record for a validated config. The stored config has no credentials.
    pub fn new(config: &TaskConfig, container_name: String, now_ms: u64) -> Self {
        Self {
            id: config.id.clone(),
            name: config.name.clone(),
            container_name,
            config: Some(Arc::new(config.without_credentials())),
            status: TaskStatus::Pending,
            termination_reason: None,
            termination_message: String::new(),
            container_id: None,
            resources: Resources::default(),
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
        }
    }
}

/// `""` (how earlier formats wrote "no container yet") read as `None`.
fn empty_is_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.filter(|id| !id.is_empty()))
}
