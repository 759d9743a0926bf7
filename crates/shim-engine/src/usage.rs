//! What each running task uses, for `/metrics`: CPU seconds, memory and its peak, OOM kills,
//! read from the task container's control group at scrape time ([`shim_resources::cgroup`]).
//!
//! This room owns one thing: where each running task's control group is. It is found once
//! per container, off the scrape's path: a scrape that meets a running task it has not
//! located yet asks the locator (a background job: one inspect for the container's main
//! process, then `/proc/<pid>/cgroup`) and leaves the task out until it is found. A scrape
//! then costs a few small in-memory file reads per task, no request to the engine's daemon.
//! Tasks that stop running are forgotten at the next scrape.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use shim_resources::cgroup::{Cgroup, Cgroups};
use shim_runtime::ContainerRuntime;
use shim_task::{TaskId, TaskStatus};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::error::chain;
use crate::table::TaskTable;

/// How long a container whose group could not be found waits before it is looked for again.
const RETRY_AFTER_NS: u64 = 60_000_000_000;

/// Where a task's control group is.
#[derive(Debug, Clone)]
enum Located {
    /// The locator was asked.
    Asked,
    /// Found.
    Found(Cgroup),
    /// Not found (the container has no process, the file is unreadable) at this time.
    Failed {
        /// When ([`Clock::mono_ns`]: a step of the wall clock must not put off the next ask).
        at_ns: u64,
    },
}

/// One task's entry: its container and where its group is.
#[derive(Debug, Clone)]
struct Entry {
    container_id: String,
    located: Located,
    /// A failure to find its group was logged as a warning already (once per task: later
    /// ones go to the debug log).
    warned: bool,
}

/// The usage room: where each running task's control group is.
pub(crate) struct Usage {
    table: Arc<TaskTable>,
    groups: Mutex<HashMap<TaskId, Entry>>,
    ask: mpsc::UnboundedSender<(TaskId, String)>,
    clock: Clock,
}

impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Usage")
            .field("located", &self.lock().len())
            .finish_non_exhaustive()
    }
}

/// One task's usage, as read now.
struct Reading {
    task: TaskId,
    usage: shim_resources::cgroup::Usage,
}

impl Usage {
    /// The room and its locator job (which ends with `shutdown`, or once the room is gone).
    pub(crate) fn spawn(
        table: Arc<TaskTable>,
        runtime: Arc<dyn ContainerRuntime>,
        cgroups: Cgroups,
        clock: Clock,
        shutdown: CancellationToken,
    ) -> (Arc<Usage>, JoinHandle<()>) {
        let (ask, mut asked) = mpsc::unbounded_channel::<(TaskId, String)>();
        let usage = Arc::new(Usage {
            table,
            groups: Mutex::new(HashMap::new()),
            ask,
            clock,
        });
        let room = Arc::downgrade(&usage);
        let job = tokio::spawn(async move {
            loop {
                let (task, container_id) = tokio::select! {
                    () = shutdown.cancelled() => return,
                    next = asked.recv() => match next {
                        Some(next) => next,
                        None => return,
                    },
                };
                let (located, why) = locate(runtime.as_ref(), &cgroups, &container_id, clock).await;
                if !record(&room, task, container_id, located, why) {
                    return;
                }
            }
        });
        (usage, job)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TaskId, Entry>> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the usage of every running task whose group is known; asks for the groups of
    /// the others and forgets the tasks that no longer run.
    fn read(&self) -> Vec<Reading> {
        let running: Vec<(TaskId, String)> = self
            .table
            .slots()
            .iter()
            .filter_map(|slot| {
                slot.read(|t| {
                    let cid = t.record().container_id.as_ref()?;
                    (t.status() == TaskStatus::Running).then(|| (t.id().clone(), cid.clone()))
                })
            })
            .collect();
        let now = self.clock.mono_ns();
        let mut found = Vec::new();
        {
            let mut groups = self.lock();
            groups.retain(|id, e| {
                running
                    .iter()
                    .any(|(rid, cid)| rid == id && *cid == e.container_id)
            });
            for (id, container_id) in running {
                let ask = match groups.get(&id) {
                    None => true,
                    Some(Entry {
                        located: Located::Failed { at_ns },
                        ..
                    }) => now.saturating_sub(*at_ns) >= RETRY_AFTER_NS,
                    Some(Entry {
                        located: Located::Found(cgroup),
                        ..
                    }) => {
                        found.push((id.clone(), cgroup.clone()));
                        false
                    }
                    Some(_) => false,
                };
                if ask {
                    let warned = groups.get(&id).is_some_and(|e| e.warned);
                    groups.insert(
                        id.clone(),
                        Entry {
                            container_id: container_id.clone(),
                            located: Located::Asked,
                            warned,
                        },
                    );
                    // The locator is gone only with the engine's shutdown.
                    let _ = self.ask.send((id, container_id));
                }
            }
        }
        // The files are read outside the lock: a scrape never holds up the locator.
        found
            .into_iter()
            .filter_map(|(task, cgroup)| match cgroup.usage() {
                Ok(usage) => Some(Reading { task, usage }),
                Err(e) => {
                    // The container ended between the table's view and the read.
                    tracing::debug!(task = %task, error = %chain(&e), "cannot read the task's cgroup");
                    None
                }
            })
            .collect()
    }

    /// Encodes the per-task usage metrics.
    pub(crate) fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let readings = self.read();
        family(
            encoder,
            "dstack_shim_task_cpu_seconds",
            "CPU time used by the task's container (its cgroup)",
            MetricType::Counter,
            &readings,
            |u| Some(Num::Float(u.cpu_seconds)),
        )?;
        family(
            encoder,
            "dstack_shim_task_memory_bytes",
            "Memory charged to the task's container now (its cgroup, page cache included)",
            MetricType::Gauge,
            &readings,
            |u| Some(Num::Int(u.memory_bytes)),
        )?;
        family(
            encoder,
            "dstack_shim_task_memory_peak_bytes",
            "The most memory charged to the task's container at once (where the kernel keeps it)",
            MetricType::Gauge,
            &readings,
            |u| u.memory_peak_bytes.map(Num::Int),
        )?;
        family(
            encoder,
            "dstack_shim_task_oom_kills",
            "Processes of the task's container ended by the kernel's OOM killer (where the kernel counts them)",
            MetricType::Counter,
            &readings,
            |u| u.oom_kills.map(Num::Int),
        )
    }
}

/// Stores what the locator found, and logs why a group was not found (a warning once per
/// task, then the debug log: the locator asks again every minute while the task runs); false
/// once the room is gone.
fn record(
    room: &Weak<Usage>,
    task: TaskId,
    container_id: String,
    located: Located,
    why: Option<String>,
) -> bool {
    let Some(room) = room.upgrade() else {
        return false;
    };
    let mut groups = room.lock();
    // Only for the container it was asked for, and only while still asked for.
    if let Some(entry) = groups.get_mut(&task)
        && entry.container_id == container_id
        && matches!(entry.located, Located::Asked)
    {
        entry.located = located;
        if let Some(error) = why {
            if entry.warned {
                tracing::debug!(%task, container = %container_id, %error, "still cannot find the container's cgroup");
            } else {
                tracing::warn!(%task, container = %container_id, %error, "cannot find the container's cgroup: its usage is not reported (asked again every minute; said once)");
                entry.warned = true;
            }
        }
    }
    true
}

/// Finds a container's group: its main process from an inspect, then the process's groups;
/// when the group of a running process cannot be found, also why (for the log).
async fn locate(
    runtime: &dyn ContainerRuntime,
    cgroups: &Cgroups,
    container_id: &str,
    clock: Clock,
) -> (Located, Option<String>) {
    let failed = Located::Failed {
        at_ns: clock.mono_ns(),
    };
    let pid = match runtime.inspect(container_id).await {
        Ok(d) => d.pid,
        Err(e) => {
            tracing::debug!(container = %container_id, error = %chain(&e), "cannot inspect the container for its cgroup");
            return (failed, None);
        }
    };
    let Some(pid) = pid else {
        return (failed, None);
    };
    match cgroups.locate_container(pid, container_id) {
        Ok(cgroup) => (Located::Found(cgroup), None),
        Err(e) => (failed, Some(format!("pid {pid}: {}", chain(&e)))),
    }
}

/// A sample's value: seconds, or a count of bytes or events.
#[derive(Clone, Copy, Debug)]
enum Num {
    Float(f64),
    Int(u64),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabels {
    task_id: String,
}

/// One metric family with a sample per task that has a value.
fn family(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    readings: &[Reading],
    value: impl Fn(&shim_resources::cgroup::Usage) -> Option<Num>,
) -> std::fmt::Result {
    let samples: Vec<(TaskLabels, Num)> = readings
        .iter()
        .filter_map(|r| {
            value(&r.usage).map(|v| {
                (
                    TaskLabels {
                        task_id: r.task.to_string(),
                    },
                    v,
                )
            })
        })
        .collect();
    if samples.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in &samples {
        let m = family.encode_family(labels)?;
        match (kind, *v) {
            (MetricType::Counter, Num::Float(v)) => ConstCounter::new(v).encode(m)?,
            (MetricType::Counter, Num::Int(v)) => ConstCounter::new(v).encode(m)?,
            (_, Num::Float(v)) => ConstGauge::new(v).encode(m)?,
            (_, Num::Int(v)) => ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m)?,
        }
    }
    Ok(())
}
