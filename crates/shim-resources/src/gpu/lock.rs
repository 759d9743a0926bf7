//! The GPU lock: hands GPUs to tasks, never over-allocating.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};

use super::HostGpus;
use crate::error::{Error, Result};

/// Hands GPUs to tasks. Locking never over-allocates: a request that cannot be met in full
/// locks nothing. Safe to share (`Arc<GpuLock>`).
#[derive(Debug)]
pub struct GpuLock {
    ids: Vec<String>,
    locked: Mutex<BTreeSet<String>>,
}

impl GpuLock {
    /// A lock over the GPUs with these ids (in allocation order).
    pub fn new(ids: impl IntoIterator<Item = String>) -> Self {
        let mut seen = BTreeSet::new();
        let ids = ids.into_iter().filter(|i| seen.insert(i.clone())).collect();
        Self {
            ids,
            locked: Mutex::new(BTreeSet::new()),
        }
    }

    /// A lock over the host's GPUs.
    pub fn for_host(gpus: &HostGpus) -> Self {
        Self::new(gpus.ids())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.locked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks `n` free GPUs: `-1` all free ones (possibly none), `0` none. Returns the locked
    /// ids; [`Error::NotEnoughGpus`] with nothing locked when fewer than `n` are free.
    pub fn acquire(&self, n: i64) -> Result<Vec<String>> {
        if n < -1 {
            return Err(Error::InvalidGpuCount { requested: n });
        }
        let mut locked = self.state();
        let free: Vec<&String> = self.ids.iter().filter(|i| !locked.contains(*i)).collect();
        let take = if n == -1 {
            free.len()
        } else {
            match usize::try_from(n) {
                Ok(k) if k <= free.len() => k,
                _ => {
                    return Err(Error::NotEnoughGpus {
                        requested: n,
                        free: free.len(),
                        total: self.ids.len(),
                    });
                }
            }
        };
        let chosen: Vec<String> = free.into_iter().take(take).cloned().collect();
        locked.extend(chosen.iter().cloned());
        Ok(chosen)
    }

    /// Locks the given ids (a restored task's GPUs). Returns only those newly locked: ids
    /// already locked or unknown to the host are left out (unknown ones are logged).
    pub fn lock(&self, ids: &[String]) -> Vec<String> {
        let mut locked = self.state();
        let mut newly = Vec::new();
        for id in ids {
            if !self.ids.contains(id) {
                tracing::warn!(gpu = %id, "cannot lock a GPU the host does not have");
                continue;
            }
            if locked.insert(id.clone()) {
                newly.push(id.clone());
            }
        }
        newly
    }

    /// Unlocks the given ids; unknown or already free ids are ignored (idempotent).
    pub fn release(&self, ids: &[String]) {
        let mut locked = self.state();
        for id in ids {
            locked.remove(id);
        }
    }

    /// The ids currently locked, sorted.
    pub fn locked(&self) -> Vec<String> {
        self.state().iter().cloned().collect()
    }

    /// How many GPUs are free.
    pub fn free_count(&self) -> usize {
        let locked = self.state();
        self.ids.iter().filter(|i| !locked.contains(*i)).count()
    }

    /// How many GPUs the lock manages.
    pub fn total(&self) -> usize {
        self.ids.len()
    }
}
