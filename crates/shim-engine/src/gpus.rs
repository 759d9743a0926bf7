//! How a task's GPUs reach its container (SPEC §6): as CDI devices, the field's way now, or
//! as upstream's device request and device mappings.
//!
//! The order, for [`GpuDeviceMode::Auto`] (the default):
//! 1. **CDI** when the engine applies CDI device requests ([`GpuSupport::cdi_spec_dirs`]:
//!    Docker 25+ with CDI on, the default from 28.2; Podman 5+), a spec in its spec dirs names
//!    the vendor's kind (`nvidia.com/gpu`, `amd.com/gpu`) and every GPU of the host has a
//!    name there ([`CdiRegistry::name_for`]: UUID first, else the index `nvidia-smi` gives the
//!    GPU): the task's GPUs go as exactly their CDI names, and the engine applies the spec
//!    (device nodes, env, libraries, hooks).
//! 2. Otherwise **upstream's way**: NVIDIA's device request (driver `nvidia`, GPU UUIDs, which
//!    needs NVIDIA's runtime hook), AMD's `/dev/kfd` and render nodes, Tenstorrent's and
//!    Intel's as they are.
//! 3. Where neither can work — NVIDIA on Podman without a spec (its Docker API ignores the
//!    `nvidia` request: the container would run without its GPUs) — the create is refused
//!    with the command that makes a spec.
//!
//! An operator forces either way ([`GpuDeviceMode::Cdi`], [`GpuDeviceMode::Legacy`]); a
//! forced CDI that cannot work refuses GPU tasks, saying why. Tenstorrent, Intel Gaudi and a
//! task's own `gpu_devices` keep upstream's device mappings whatever the mode.
//!
//! The decision is a pure function ([`decide`]) of the mode, the host's GPUs, what the engine
//! says it can do and the specs on disk; the room re-reads the specs at each GPU task's create
//! (a spec written after the shim started, as `nvidia-cdi-refresh` does at boot, is taken
//! then) and logs each change of decision.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use shim_resources::gpu::cdi::kind_of;
use shim_resources::gpu::{GpuHealth, GpuHealthReport, GpuHealthSource, UnhealthyReason};
use shim_resources::{CdiRegistry, GpuLock, GpuVendor, HostGpus};
use shim_runtime::{ContainerRuntime, GpuSupport};

use crate::error::chain;

/// How the operator wants GPUs passed to containers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GpuDeviceMode {
    /// CDI where it can work, else upstream's way (see the module docs).
    #[default]
    Auto,
    /// CDI only: GPU tasks are refused where it cannot work.
    Cdi,
    /// Upstream's device request and device mappings only (never CDI).
    Legacy,
}

impl GpuDeviceMode {
    /// The mode's name on the command line: `auto`, `cdi`, `legacy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Cdi => "cdi",
            Self::Legacy => "legacy",
        }
    }
}

impl std::str::FromStr for GpuDeviceMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" | "" => Ok(Self::Auto),
            "cdi" => Ok(Self::Cdi),
            "legacy" => Ok(Self::Legacy),
            other => Err(format!(
                "invalid GPU device mode {other:?}: use auto, cdi or legacy"
            )),
        }
    }
}

/// How GPUs go to containers now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Passing {
    /// As CDI devices: each GPU id's fully qualified CDI name.
    Cdi(BTreeMap<String, String>),
    /// Upstream's device request and device mappings.
    Legacy,
    /// GPU tasks cannot get their GPUs: why, and what to do.
    Refused(String),
}

impl Passing {
    /// The name of the way, for logs and metrics: `cdi`, `legacy`, `refused`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Cdi(_) => "cdi",
            Self::Legacy => "legacy",
            Self::Refused(_) => "refused",
        }
    }
}

/// The command that makes a vendor's CDI spec.
fn spec_command(vendor: GpuVendor) -> &'static str {
    match vendor {
        GpuVendor::Amd => "amd-ctk cdi generate --output=/etc/cdi/amd.json",
        _ => "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml",
    }
}

/// Decides how GPUs go to containers (see the module docs); the decision and why.
pub(crate) fn decide(
    mode: GpuDeviceMode,
    host: &HostGpus,
    support: &GpuSupport,
    specs: &CdiRegistry,
) -> (Passing, String) {
    let Some(vendor) = host.vendor else {
        return (Passing::Legacy, "the host has no GPUs".to_owned());
    };
    let Some(kind) = kind_of(vendor) else {
        return (
            Passing::Legacy,
            format!("{vendor} devices are mapped as upstream maps them (no CDI kind)"),
        );
    };
    let engine = &support.engine;
    let legacy_works = vendor != GpuVendor::Nvidia || support.nvidia_requests;
    let cannot_legacy = || match &support.cdi_spec_dirs {
        Some(_) => format!(
            "{engine} ignores NVIDIA device requests through its Docker API, so a container \
             would run without its GPUs; make a CDI spec (`{}`): the next GPU task reads it",
            spec_command(vendor)
        ),
        None => format!(
            "{engine} applies neither NVIDIA device requests nor CDI ones through its Docker \
             API, so a container would run without its GPUs: GPU tasks need Podman 5 with a \
             CDI spec (`{}`), or Docker",
            spec_command(vendor)
        ),
    };
    if mode == GpuDeviceMode::Legacy {
        return if legacy_works {
            (Passing::Legacy, "upstream's way, as configured".to_owned())
        } else {
            (
                Passing::Refused(cannot_legacy()),
                "as configured".to_owned(),
            )
        };
    }
    let cdi = match (&support.cdi_spec_dirs, specs.kind(kind)) {
        (None, _) if engine.starts_with("Podman") => Err(format!(
            "{engine} applies no CDI device requests through its Docker API (Podman does from \
             version 5)"
        )),
        (None, _) => Err(format!(
            "{engine} applies no CDI device requests (Docker does from 25, on by default from \
             28.2; 25 to 28.1 need \"features\": {{\"cdi\": true}} in daemon.json)"
        )),
        (Some(dirs), None) => Err(format!(
            "no CDI spec names {kind} in {} (make one: `{}`)",
            dirs_text(dirs),
            spec_command(vendor)
        )),
        (Some(_), Some(_)) => {
            let mut names = BTreeMap::new();
            let mut missing = Vec::new();
            for gpu in &host.gpus {
                match specs.name_for(kind, gpu) {
                    Some(name) => {
                        names.insert(gpu.id.clone(), name);
                    }
                    None => missing.push(gpu.id.clone()),
                }
            }
            if missing.is_empty() {
                Ok(names)
            } else {
                Err(format!(
                    "the CDI spec of {kind} names no device for GPU(s) {} (a stale spec: \
                     `{}`)",
                    missing.join(", "),
                    spec_command(vendor)
                ))
            }
        }
    };
    match (cdi, mode) {
        (Ok(names), _) => {
            let files: Vec<String> = specs
                .kind(kind)
                .into_iter()
                .flat_map(|d| d.values().map(|d| d.spec.display().to_string()))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            (
                Passing::Cdi(names),
                format!("{engine} applies CDI; {kind} from {}", files.join(", ")),
            )
        }
        (Err(why), GpuDeviceMode::Cdi) => (Passing::Refused(why), "CDI, as configured".into()),
        (Err(why), _) if legacy_works => (Passing::Legacy, why),
        (Err(why), _) if support.cdi_spec_dirs.is_none() => {
            (Passing::Refused(cannot_legacy()), why)
        }
        (Err(why), _) => (Passing::Refused(format!("{}: {why}", cannot_legacy())), why),
    }
}

fn dirs_text(dirs: &[PathBuf]) -> String {
    let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    dirs.join(", ")
}

/// The room that decides how GPUs reach containers: the mode, the host's GPUs, what the
/// engine said it can do (asked once it answers), and the last decision.
pub(crate) struct GpuPassing {
    mode: GpuDeviceMode,
    host: HostGpus,
    runtime: Arc<dyn ContainerRuntime>,
    support: tokio::sync::Mutex<Option<GpuSupport>>,
    last: Mutex<Option<Passing>>,
}

impl GpuPassing {
    /// The room for `host`'s GPUs on `runtime`, in `mode`.
    pub(crate) fn new(
        mode: GpuDeviceMode,
        host: HostGpus,
        runtime: Arc<dyn ContainerRuntime>,
    ) -> Self {
        Self {
            mode,
            host,
            runtime,
            support: tokio::sync::Mutex::new(None),
            last: Mutex::new(None),
        }
    }

    /// Forgets what the engine said it can do with GPUs: asked again at the next GPU task's
    /// create (an ask under way sets what it gets).
    pub(crate) fn forget_support(&self) {
        if let Ok(mut known) = self.support.try_lock() {
            *known = None;
        }
    }

    /// How GPUs go while the engine cannot be asked (asked again next time): as last decided;
    /// with nothing decided yet, upstream's way, unless the mode allows only CDI.
    fn unasked(&self, e: &shim_runtime::RuntimeError) -> Passing {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match (last.as_ref(), self.mode) {
            (Some(last), _) => last.clone(),
            (None, GpuDeviceMode::Cdi) => Passing::Refused(format!(
                "cannot ask the engine whether it applies CDI: {}",
                chain(e)
            )),
            (None, _) => Passing::Legacy,
        }
    }

    /// How GPUs go to containers now (the specs read again; a change is logged).
    pub(crate) async fn current(&self) -> Passing {
        if self.host.gpus.is_empty() {
            return Passing::Legacy;
        }
        let support = {
            let mut known = self.support.lock().await;
            match known.as_ref() {
                Some(s) => s.clone(),
                None => match self.runtime.gpu_support().await {
                    Ok(s) => {
                        *known = Some(s.clone());
                        s
                    }
                    Err(e) => {
                        tracing::warn!(error = %chain(&e), "cannot ask the engine what it can do with GPUs");
                        return self.unasked(&e);
                    }
                },
            }
        };
        let dirs = support.cdi_spec_dirs.clone().unwrap_or_default();
        let specs = tokio::task::spawn_blocking(move || CdiRegistry::load(&dirs))
            .await
            .unwrap_or_default();
        for error in specs.errors() {
            tracing::warn!(%error, "a CDI spec cannot be read");
        }
        let (passing, why) = decide(self.mode, &self.host, &support, &specs);
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_ref() != Some(&passing) {
            match &passing {
                Passing::Refused(what) => {
                    tracing::error!(mode = self.mode.as_str(), why = %what, "GPU tasks cannot get their GPUs")
                }
                Passing::Cdi(names) => {
                    tracing::debug!(devices = ?names, "the GPUs' CDI names");
                    tracing::info!(mode = self.mode.as_str(), gpus = names.len(), %why, "GPUs go to containers as CDI devices")
                }
                Passing::Legacy => {
                    tracing::info!(mode = self.mode.as_str(), %why, "GPUs go to containers as upstream passes them (device request, device mappings)")
                }
            }
            *last = Some(passing.clone());
        }
        passing
    }

    /// The last decision's name (`None` before the first).
    pub(crate) fn last_name(&self) -> Option<&'static str> {
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Passing::name)
    }
}

/// `report` as shown (the metrics' `gpu_unhealthy`, the instance health answer): each GPU with
/// the reasons the lock keeps it out for (`kept`), those carried over from a source that
/// could not be read included; a kept GPU the report does not list (`nvidia-smi` failed) is
/// listed as `previous` showed it, in index order.
fn with_kept_reasons(
    mut report: GpuHealthReport,
    kept: &BTreeMap<String, Vec<UnhealthyReason>>,
    previous: Option<&GpuHealthReport>,
) -> GpuHealthReport {
    for (gpu, reasons) in kept {
        let listed = (report
            .get(gpu)
            .or_else(|| previous.and_then(|p| p.get(gpu)))
            .cloned())
        .unwrap_or_else(|| GpuHealth {
            uuid: gpu.clone(),
            index: u32::MAX,
            bus_id: String::new(),
            reasons: Vec::new(),
        });
        for reason in reasons {
            report.add_reason_listed(&listed, reason.clone());
        }
    }
    report
}

/// The GPUs' health, watched: every interval the source is probed, the unhealthy GPUs are kept
/// from new tasks by the lock (running tasks keep theirs), each change is logged, and the last
/// report is kept for `/metrics` and the instance health answer. A GPU healthy again is
/// handed out again.
pub(crate) struct GpuHealthWatch {
    last: Mutex<Option<GpuHealthReport>>,
    /// The reasons the GPUs are kept out for now, by GPU, as their sources gave them (what
    /// a partial report carries over of the sources it could not read).
    kept: Mutex<BTreeMap<String, Vec<UnhealthyReason>>>,
}

impl GpuHealthWatch {
    /// A watch with nothing known yet.
    pub(crate) fn new() -> Self {
        Self {
            last: Mutex::new(None),
            kept: Mutex::new(BTreeMap::new()),
        }
    }

    /// The last report (`None`: no source, or not probed yet).
    pub(crate) fn last(&self) -> Option<GpuHealthReport> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One probe: the lock keeps the unhealthy GPUs from new tasks; changes are logged. A
    /// partial report (a source that could not be read: [`GpuHealthReport::errors`]) clears
    /// none of the reasons that source gave: not being read is no sign of a GPU's recovery;
    /// the sources it did read clear theirs (DCGM failing for good does not keep a GPU out
    /// that `nvidia-smi` finds healthy again).
    pub(crate) async fn probe(&self, source: &dyn GpuHealthSource, lock: &GpuLock) {
        let report = source.probe().await;
        let mut now: BTreeMap<String, Vec<UnhealthyReason>> = report
            .unhealthy()
            .map(|g| (g.uuid.clone(), g.reasons.clone()))
            .collect();
        {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            for (gpu, reasons) in kept.iter() {
                // A GPU the partial report does not list (`nvidia-smi`, which lists them,
                // failed): no source could attach a reason to it, so all of its are kept.
                let unlisted = !report.errors.is_empty() && report.get(gpu).is_none();
                let carried = |r: &&UnhealthyReason| unlisted || report.missing(r.source());
                for reason in reasons.iter().filter(carried) {
                    let list = now.entry(gpu.clone()).or_default();
                    if !list.contains(reason) {
                        list.push(reason.clone());
                    }
                }
            }
            kept.clone_from(&now);
        }
        let unhealthy: BTreeMap<String, Vec<String>> = now
            .iter()
            .map(|(gpu, reasons)| {
                (
                    gpu.clone(),
                    reasons.iter().map(ToString::to_string).collect(),
                )
            })
            .collect();
        let before = lock.unhealthy();
        for (gpu, reasons) in &unhealthy {
            if before.get(gpu) != Some(reasons) {
                tracing::warn!(%gpu, ?reasons, "a GPU is unhealthy: it is not given to new tasks (tasks holding it keep it)");
            }
        }
        for gpu in before.keys().filter(|g| !unhealthy.contains_key(*g)) {
            tracing::info!(%gpu, "a GPU is healthy again: it is given to new tasks");
        }
        lock.set_unhealthy(unhealthy);
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let shown = with_kept_reasons(report, &now, last.as_ref());
        *last = Some(shown);
    }

    /// Probes `source` now and then every `every` until `shutdown`.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        source: Arc<dyn GpuHealthSource>,
        lock: Arc<GpuLock>,
        every: std::time::Duration,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let watch = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let Some(watch) = watch.upgrade() else { return };
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = watch.probe(source.as_ref(), &lock) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use shim_resources::gpu::{GpuHealth, UnhealthyReason};

    use super::*;

    // The engine cannot be asked what it can do with GPUs (an `/info` that timed out) before
    // any decision: a `cdi`-only shim refuses, saying why, where it used to send upstream's
    // device request the operator had ruled out; `auto` goes upstream's way. After a decision,
    // one failed ask keeps it (a CDI host stayed CDI on Podman, whose Docker API ignores the
    // device request).
    #[tokio::test]
    async fn an_engine_that_cannot_be_asked_keeps_the_mode_or_the_last_decision() {
        let host = HostGpus::fake_nvidia(1);
        let runtime = Arc::new(shim_runtime::fake::FakeRuntime::new());
        runtime.set_unreachable(true);
        let passing = |mode| GpuPassing::new(mode, host.clone(), runtime.clone());
        let cdi = passing(GpuDeviceMode::Cdi);
        let refused = cdi.current().await;
        let Passing::Refused(why) = &refused else {
            panic!("{refused:?}");
        };
        assert!(
            why.contains("cannot ask the engine whether it applies CDI"),
            "{why}"
        );
        assert_eq!(
            passing(GpuDeviceMode::Auto).current().await,
            Passing::Legacy
        );

        let dir = tempfile::tempdir().unwrap();
        let spec = format!(
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: {}\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n",
            host.gpus[0].id
        );
        fs_err::write(dir.path().join("nvidia.yaml"), spec).unwrap();
        let dirs = Some(vec![dir.path().to_owned()]);
        runtime.set_gpu_support(shim_runtime::GpuSupport::new("Podman 5.4.2", dirs, false));
        runtime.set_unreachable(false);
        let auto = passing(GpuDeviceMode::Auto);
        let decided = auto.current().await;
        assert!(matches!(decided, Passing::Cdi(_)), "{decided:?}");
        auto.forget_support();
        runtime.set_unreachable(true);
        assert_eq!(auto.current().await, decided);
    }

    /// A health source that answers its reports in turn.
    struct Reports(Mutex<Vec<GpuHealthReport>>);

    #[async_trait::async_trait]
    impl GpuHealthSource for Reports {
        async fn probe(&self) -> GpuHealthReport {
            self.0.lock().unwrap().remove(0)
        }
    }

    // A partial health report that does not say which source it could not read adds what it
    // read but clears no GPU: one kept out stays out until a complete report finds it healthy
    // (SPEC §7: not given to new tasks while bad). It used to replace the whole set, so an
    // `nvidia-smi` that failed once put a bad GPU back in service.
    #[tokio::test]
    async fn a_partial_health_report_clears_no_gpu() {
        let gpu = |uuid: &str, index, bad: bool| GpuHealth {
            uuid: uuid.into(),
            index,
            bus_id: String::new(),
            reasons: match bad {
                true => vec![UnhealthyReason::RetiredPagesPending],
                false => vec![],
            },
        };
        let complete = |a, b| GpuHealthReport {
            gpus: vec![gpu("GPU-a", 0, a), gpu("GPU-b", 1, b)],
            ..GpuHealthReport::default()
        };
        let partial = |gpus| GpuHealthReport {
            gpus,
            errors: vec!["nvidia-smi -q failed".into()],
            ..GpuHealthReport::default()
        };
        let reports = vec![
            complete(true, false),
            partial(vec![]),
            partial(vec![gpu("GPU-b", 1, true)]),
            complete(false, false),
        ];
        let source = Reports(Mutex::new(reports));
        let lock = GpuLock::new(["GPU-a".to_owned(), "GPU-b".to_owned()]);
        let watch = GpuHealthWatch::new();
        let kept = |lock: &GpuLock| lock.unhealthy().into_keys().collect::<Vec<_>>();
        let expected: [&[&str]; 4] = [&["GPU-a"], &["GPU-a"], &["GPU-a", "GPU-b"], &[]];
        for (probe, expected) in expected.into_iter().enumerate() {
            watch.probe(&source, &lock).await;
            assert_eq!(kept(&lock), expected, "probe {probe}");
            // What the metrics and the instance health answer show: the same GPUs.
            let shown = watch.last().unwrap().unhealthy_ids();
            assert_eq!(shown, expected, "shown at probe {probe}");
        }
        assert_eq!(lock.acquire(2).unwrap().len(), 2);
    }

    // A source that cannot be read keeps only its own reasons: DCGM failing for good (its
    // private host engine crash-looping) does not keep out a GPU whose row remapping
    // `nvidia-smi` reads done, while a DCGM incident stays while DCGM cannot be read.
    #[tokio::test]
    async fn a_source_that_cannot_be_read_keeps_only_its_own_reasons() {
        use shim_resources::gpu::HealthSource;
        let gpu = |uuid: &str, index, reasons: Vec<UnhealthyReason>| GpuHealth {
            uuid: uuid.into(),
            index,
            bus_id: String::new(),
            reasons,
        };
        let remap = UnhealthyReason::RowRemapPending;
        let incident = UnhealthyReason::dcgm("memory", "ECC errors");
        let without_dcgm = |a: Vec<UnhealthyReason>| {
            let mut report = GpuHealthReport {
                gpus: vec![gpu("GPU-a", 0, a), gpu("GPU-b", 1, vec![])],
                ..GpuHealthReport::default()
            };
            report.unreadable(HealthSource::Dcgm, "DCGM's health check could not be read");
            report
        };
        let complete = GpuHealthReport {
            gpus: vec![
                gpu("GPU-a", 0, vec![remap.clone()]),
                gpu("GPU-b", 1, vec![incident]),
            ],
            ..GpuHealthReport::default()
        };
        // `nvidia-smi` failing: no GPU is listed, so DCGM's incident on GPU-b, though read,
        // finds no GPU to attach to; GPU-b stays out all the same.
        let mut without_smi = GpuHealthReport::default();
        without_smi.unreadable(HealthSource::NvidiaSmi, "nvidia-smi -q failed");
        let reports = vec![
            complete,
            without_dcgm(vec![remap]),
            without_dcgm(vec![]),
            without_smi,
        ];
        let source = Reports(Mutex::new(reports));
        let lock = GpuLock::new(["GPU-a".to_owned(), "GPU-b".to_owned()]);
        let watch = GpuHealthWatch::new();
        let kept = |lock: &GpuLock| lock.unhealthy().into_keys().collect::<Vec<_>>();
        let expected: [&[&str]; 4] = [
            &["GPU-a", "GPU-b"],
            &["GPU-a", "GPU-b"],
            &["GPU-b"],
            &["GPU-b"],
        ];
        for (probe, expected) in expected.into_iter().enumerate() {
            watch.probe(&source, &lock).await;
            assert_eq!(kept(&lock), expected, "probe {probe}");
            // What the metrics and the instance health answer show: the same GPUs.
            let shown = watch.last().unwrap().unhealthy_ids();
            assert_eq!(shown, expected, "shown at probe {probe}");
        }
    }

    fn nvidia(n: u32) -> HostGpus {
        HostGpus::fake_nvidia(n)
    }

    fn specs(text: &str) -> (tempfile::TempDir, CdiRegistry) {
        let dir = tempfile::tempdir().unwrap();
        fs_err::write(dir.path().join("nvidia.yaml"), text).unwrap();
        let r = CdiRegistry::load(&[dir.path().to_owned()]);
        (dir, r)
    }

    const TWO: &str = "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- name: \"1\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia1\n";

    fn docker(cdi: bool) -> GpuSupport {
        GpuSupport::new(
            "Docker 28.5.2",
            cdi.then(|| vec!["/etc/cdi".into(), "/var/run/cdi".into()]),
            true,
        )
    }

    fn podman(cdi: bool) -> GpuSupport {
        GpuSupport::new(
            if cdi { "Podman 5.4.2" } else { "Podman 4.3.1" },
            cdi.then(|| vec!["/etc/cdi".into(), "/var/run/cdi".into()]),
            false,
        )
    }

    #[test]
    fn cdi_first_where_it_works_by_index_names() {
        let (_d, s) = specs(TWO);
        let (passing, why) = decide(GpuDeviceMode::Auto, &nvidia(2), &docker(true), &s);
        let Passing::Cdi(names) = passing else {
            panic!("{passing:?}: {why}")
        };
        let host = nvidia(2);
        assert_eq!(names[&host.gpus[0].id], "nvidia.com/gpu=0");
        assert_eq!(names[&host.gpus[1].id], "nvidia.com/gpu=1");
        assert!(why.contains("nvidia.yaml"), "{why}");
        let (passing, _) = decide(GpuDeviceMode::Auto, &nvidia(2), &podman(true), &s);
        assert!(matches!(passing, Passing::Cdi(_)), "Podman 5 applies CDI");
    }

    #[test]
    fn upstream_s_way_where_cdi_cannot_work_and_a_refusal_where_neither_can() {
        let (_d, s) = specs(TWO);
        let none = CdiRegistry::default();
        // Docker without CDI, or without a spec, or with a stale one: the device request.
        for (support, specs, said) in [
            (docker(false), &s, "applies no CDI"),
            (docker(true), &none, "no CDI spec names nvidia.com/gpu"),
        ] {
            let (passing, why) = decide(GpuDeviceMode::Auto, &nvidia(2), &support, specs);
            assert_eq!(passing, Passing::Legacy);
            assert!(why.contains(said), "{why}");
        }
        let (passing, why) = decide(GpuDeviceMode::Auto, &nvidia(3), &docker(true), &s);
        assert_eq!(passing, Passing::Legacy);
        assert!(why.contains("names no device for GPU(s)"), "{why}");
        // Podman without a spec: refused, with the command.
        for support in [podman(true), podman(false)] {
            let (passing, _) = decide(GpuDeviceMode::Auto, &nvidia(2), &support, &none);
            let Passing::Refused(what) = passing else {
                panic!("{passing:?}")
            };
            assert!(
                what.contains("NVIDIA device requests")
                    && what.contains("nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"),
                "{what}"
            );
        }
        // Podman 4.3 with a spec still cannot: its Docker API applies no CDI.
        let (passing, _) = decide(GpuDeviceMode::Auto, &nvidia(2), &podman(false), &s);
        assert!(
            matches!(passing, Passing::Refused(ref w) if w.contains("applies neither NVIDIA device requests nor CDI ones") && w.contains("Podman 5")),
            "{passing:?}"
        );
    }

    #[test]
    fn forced_modes() {
        let (_d, s) = specs(TWO);
        let (passing, _) = decide(GpuDeviceMode::Legacy, &nvidia(2), &docker(true), &s);
        assert_eq!(passing, Passing::Legacy, "legacy never uses CDI");
        let (passing, _) = decide(GpuDeviceMode::Legacy, &nvidia(2), &podman(true), &s);
        assert!(matches!(passing, Passing::Refused(_)), "{passing:?}");
        let (passing, _) = decide(
            GpuDeviceMode::Cdi,
            &nvidia(2),
            &docker(true),
            &CdiRegistry::default(),
        );
        assert!(
            matches!(passing, Passing::Refused(ref w) if w.contains("no CDI spec")),
            "a forced CDI without a spec refuses rather than falling back: {passing:?}"
        );
        let (passing, _) = decide(GpuDeviceMode::Cdi, &nvidia(2), &docker(true), &s);
        assert!(matches!(passing, Passing::Cdi(_)));
        assert_eq!("cdi".parse::<GpuDeviceMode>(), Ok(GpuDeviceMode::Cdi));
        assert_eq!("".parse::<GpuDeviceMode>(), Ok(GpuDeviceMode::Auto));
        assert!("nvidia".parse::<GpuDeviceMode>().is_err());
    }

    #[test]
    fn vendors_without_a_cdi_kind_and_hosts_without_gpus_keep_upstream_s_way() {
        let (_d, s) = specs(TWO);
        let (passing, _) = decide(GpuDeviceMode::Cdi, &HostGpus::none(), &docker(true), &s);
        assert_eq!(passing, Passing::Legacy);
        let mut tt = nvidia(1);
        tt.vendor = Some(GpuVendor::Tenstorrent);
        let (passing, _) = decide(GpuDeviceMode::Cdi, &tt, &docker(true), &s);
        assert_eq!(passing, Passing::Legacy);
    }
}
