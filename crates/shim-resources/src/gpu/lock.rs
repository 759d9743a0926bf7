//! The GPU lock: hands GPUs to tasks, never over-allocating.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use super::HostGpus;
use super::topo::{Topology, choose};
use crate::error::{ResourcesError, Result};

/// Hands GPUs to tasks. Locking never over-allocates: a request that cannot be met in full
/// locks nothing. Safe to share (`Arc<GpuLock>`).
///
/// Of the free GPUs, a request for `k` takes the best-linked set by the host's interconnect
/// ([`GpuLock::set_topology`], the placement rule of [`super::topo`]: one NUMA node where one
/// can hold it, then the best links), never refusing what a first-free choice would meet; a
/// GPU its health source marks bad ([`GpuLock::set_unhealthy`]) is not handed to a new task
/// while bad (the tasks holding it keep it).
#[derive(Debug)]
pub struct GpuLock {
    ids: Vec<String>,
    /// Each GPU's index in the vendor tool's list (the topology's names).
    index: BTreeMap<String, u32>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    locked: BTreeSet<String>,
    topology: Option<Topology>,
    /// Unhealthy GPUs and why.
    unhealthy: BTreeMap<String, Vec<String>>,
}

impl GpuLock {
    /// A lock over the GPUs with these ids (in allocation order; their indexes in that
    /// order).
    pub fn new(ids: impl IntoIterator<Item = String>) -> Self {
        let mut seen = BTreeSet::new();
        let ids: Vec<String> = ids.into_iter().filter(|i| seen.insert(i.clone())).collect();
        let index = ids
            .iter()
            .zip(0u32..)
            .map(|(id, i)| (id.clone(), i))
            .collect();
        Self {
            ids,
            index,
            state: Mutex::new(State::default()),
        }
    }

    /// A lock over the host's GPUs (each known by its index in the vendor tool's list).
    pub fn for_host(gpus: &HostGpus) -> Self {
        let mut lock = Self::new(gpus.ids());
        for gpu in &gpus.gpus {
            lock.index.insert(gpu.id.clone(), gpu.index);
        }
        lock
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The host's interconnect (`None`: unknown; placement is then first-free).
    pub fn set_topology(&self, topology: Option<Topology>) {
        self.state().topology = topology;
    }

    /// The GPUs that must not go to new tasks, each with why (replacing the last set: a GPU
    /// not in it is healthy again). Ids the host does not have are ignored.
    pub fn set_unhealthy(&self, unhealthy: BTreeMap<String, Vec<String>>) {
        self.state().unhealthy = unhealthy
            .into_iter()
            .filter(|(id, _)| self.index.contains_key(id))
            .collect();
    }

    /// The GPUs kept from new tasks now, each with why.
    pub fn unhealthy(&self) -> BTreeMap<String, Vec<String>> {
        self.state().unhealthy.clone()
    }

    /// Locks `n` free GPUs: `-1` all free healthy ones (possibly none), `0` none. Returns the
    /// locked ids (the best-linked set of the free healthy ones); [`ResourcesError::NotEnoughGpus`]
    /// with nothing locked when fewer than `n` are free and healthy, naming the free ones
    /// kept out as unhealthy and why.
    pub fn acquire(&self, n: i64) -> Result<Vec<String>> {
        if n < -1 {
            return Err(ResourcesError::InvalidGpuCount { requested: n });
        }
        let mut state = self.state();
        let free: Vec<&String> = self
            .ids
            .iter()
            .filter(|i| !state.locked.contains(*i))
            .collect();
        let healthy: Vec<&String> = free
            .iter()
            .copied()
            .filter(|i| !state.unhealthy.contains_key(*i))
            .collect();
        let take = if n == -1 {
            healthy.len()
        } else {
            match usize::try_from(n) {
                Ok(k) if k <= healthy.len() => k,
                _ => {
                    let unhealthy = free
                        .iter()
                        .filter_map(|id| {
                            let why = state.unhealthy.get(*id)?;
                            Some(format!("{id} ({})", why.join("; ")))
                        })
                        .collect();
                    return Err(ResourcesError::NotEnoughGpus {
                        requested: n,
                        free: healthy.len(),
                        total: self.ids.len(),
                        unhealthy,
                    });
                }
            }
        };
        let indexes: Vec<u32> = healthy
            .iter()
            .filter_map(|id| self.index.get(*id).copied())
            .collect();
        let by_index: BTreeMap<u32, &String> = healthy
            .iter()
            .filter_map(|id| Some((*self.index.get(*id)?, *id)))
            .collect();
        let chosen: Vec<String> = match choose(state.topology.as_ref(), &indexes, take) {
            Some(set) if set.len() == take => set
                .iter()
                .filter_map(|i| by_index.get(i).map(|id| (*id).clone()))
                .collect(),
            // Never reached (the healthy GPUs number at least `take`); first-free all the same.
            _ => healthy.into_iter().take(take).cloned().collect(),
        };
        state.locked.extend(chosen.iter().cloned());
        Ok(chosen)
    }

    /// Locks the given ids (a restored task's GPUs). Returns only those newly locked: ids
    /// already locked or unknown to the host are left out (unknown ones are logged).
    pub fn lock(&self, ids: &[String]) -> Vec<String> {
        let locked = &mut self.state().locked;
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
        let locked = &mut self.state().locked;
        for id in ids {
            locked.remove(id);
        }
    }

    /// The ids currently locked, sorted.
    pub fn locked(&self) -> Vec<String> {
        self.state().locked.iter().cloned().collect()
    }

    /// How many GPUs are free (healthy or not).
    pub fn free_count(&self) -> usize {
        let state = self.state();
        self.ids
            .iter()
            .filter(|i| !state.locked.contains(*i))
            .count()
    }

    /// How many GPUs the lock manages.
    pub fn total(&self) -> usize {
        self.ids.len()
    }
}
