//! The task table: every task this engine knows, by id. A slot enters at submit or restore
//! and leaves when its remove forgets it; what a slot holds is the driver's
//! ([`crate::records::Slot`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use shim_task::TaskId;

use crate::error::{EngineError, Result};
use crate::records::Slot;

/// Every task, by id.
#[derive(Default)]
pub(crate) struct TaskTable {
    slots: Mutex<BTreeMap<TaskId, Arc<Slot>>>,
}

impl TaskTable {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<TaskId, Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The task `id`.
    pub(crate) fn get(&self, id: &TaskId) -> Result<Arc<Slot>> {
        self.lock()
            .get(id)
            .cloned()
            .ok_or_else(|| EngineError::NotFound(id.clone()))
    }

    /// Every task, in id order.
    pub(crate) fn slots(&self) -> Vec<Arc<Slot>> {
        self.lock().values().cloned().collect()
    }

    /// The task whose container is named `name`.
    pub(crate) fn by_container_name(&self, name: &str) -> Option<Arc<Slot>> {
        self.lock()
            .values()
            .find(|s| s.container_name == name)
            .cloned()
    }

    /// Adds a submitted task; refused if its id is known.
    pub(crate) fn insert_new(&self, slot: Arc<Slot>) -> Result<()> {
        let mut table = self.lock();
        if table.contains_key(&slot.id) {
            return Err(EngineError::AlreadyExists(slot.id.clone()));
        }
        table.insert(slot.id.clone(), slot);
        Ok(())
    }

    /// Adds a restored task; the task it replaces, if one had its id.
    pub(crate) fn insert(&self, slot: Arc<Slot>) -> Option<Arc<Slot>> {
        self.lock().insert(slot.id.clone(), slot)
    }

    /// Forgets the task `id`.
    pub(crate) fn remove(&self, id: &TaskId) {
        self.lock().remove(id);
    }

    /// Forgets `slot` if it is still the table's entry for its task (a task submitted again
    /// under the same id is another slot, left alone); whether it was.
    pub(crate) fn remove_slot(&self, slot: &Arc<Slot>) -> bool {
        let mut table = self.lock();
        let held = table.get(&slot.id).is_some_and(|s| Arc::ptr_eq(s, slot));
        if held {
            table.remove(&slot.id);
        }
        held
    }

    /// Whether `slot` is still the table's entry for its task (not removed).
    pub(crate) fn holds(&self, slot: &Arc<Slot>) -> bool {
        self.lock()
            .get(&slot.id)
            .is_some_and(|s| Arc::ptr_eq(s, slot))
    }

    /// How many tasks.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}
