//! Image garbage collection: the disk does not fill with images.
//!
//! Kubelet's thresholds and semantics: when the file system of the engine's data root is used
//! above `high` percent, images are removed, least recently used first, until it is used
//! below `low` percent. Only images this shim pulled are candidates, and never one a task it
//! knows refers to — running, starting, pulling, or terminated and not yet removed (a task the
//! server may still restart or inspect); the engine itself refuses to remove an image any
//! container uses (the removal is never forced), which covers containers that are not this
//! shim's.
//!
//! **The ledger** (`<home>/images.json`, kept across restarts) records *image ids*: for each
//! image a pull of this shim produced, the names it was pulled as (in their normalised form,
//! [`shim_runtime::normalize_reference`], so `ubuntu:22.04` and
//! `docker.io/library/ubuntu:22.04` are one name) and when it was pulled and last used. An
//! id is collected only while a recorded name still points to it (its recorded names are
//! removed, never a name someone else gave it), or when no name points to it any more (a
//! tag moved by a later pull: the old image is dangling, and it was this shim's). An image
//! built or tagged by someone else under a name the shim once pulled has another id: it is
//! never this shim's to remove. The name of an absent image is recorded before its pull (and
//! resolved to an id by a later pass, should the shim stop before the pull's end is recorded;
//! a pull that fails takes its name back, and no pass resolves a name whose pull is out).
//! A record goes when its image does: at a removal the engine
//! reports ([`ImageGc::image_id_removed`]: asked once, forgotten if gone), or when a pass finds
//! it gone.
//!
//! **Freed bytes are measured**, not taken from the engine's `Size`: images share layers (one
//! CUDA base under many images), a name removed while another names the same image frees
//! nothing, and a removal the engine answers "not found" freed nothing either. After each
//! removal the file system is measured again; a pass stops as soon as it is under its target,
//! and what it freed is what the file system got back.
//!
//! **One writer, in order**: the ledger is written by one write at a time, each taking its
//! snapshot once it holds the writer, so an older snapshot never lands over a newer one. A
//! ledger that cannot be read (garbage, a newer format) is moved aside
//! (`images.json.corrupt-<ms>`), logged, and counted in
//! `dstack_shim_image_ledger_corrupt_total`, as the task records are; the temp files a
//! crashed write left are removed at start-up. A ledger of the first format (version 1,
//! keyed by name) is read: its names are resolved to the ids they point to at the first
//! pass.
//!
//! A pass runs before each pull, after each pull, and every [`CHECK_EVERY`]; a pull whose
//! remaining bytes (the layers' sizes as the progress stream announces them, compressed, so
//! a lower bound of what it needs) exceed what the file system has left asks for a pass that
//! frees that much, and fails at once when even that cannot make room
//! ([`ImageGc::make_room`]). `high` = 100 turns collection off; the fit check stays.
//!
//! **Images seen present.** The pull step asks the engine whether a task's image is present
//! (on Docker's containerd store an image inspect costs ~14 ms, a tenth of a task's start), so
//! the room remembers the names it saw present ([`ImageGc::known_present`]) for as long as
//! the engine's event stream is connected: any image removal the engine reports (an
//! operator's `docker image prune`, `docker rmi`, this room's own collection) forgets them
//! all, and so does a lost connection. A task whose image was removed is pulled again in its
//! pull step, in the open. A pull step does not decide, nor pull, while this room removes its
//! image (a removal takes seconds on a large one): it waits, then finds the image gone; a pull
//! step of another image does not wait.
//!
//! The room owns the ledger and the policy; the effects tell it what was pulled and used.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shim_resources::host::{FsProbe, FsUsage};
use shim_runtime::{ContainerRuntime, ImageDetails, RuntimeError, normalize_reference};

use crate::clock::Clock;
use crate::error::chain;
use crate::table::TaskTable;

/// How often the background check looks at the file system.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(60);

/// The ledger's file in the home.
const LEDGER_FILE: &str = "images.json";

/// The ledger's format: by image id.
const LEDGER_VERSION: u32 = 2;

/// When an image was pulled by this shim and last used by a task (Unix ms): the first
/// format's record, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Seen {
    pulled_ms: u64,
    last_used_ms: u64,
}

/// An image a pull of this shim produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Pulled {
    /// The names it was pulled as, normalised.
    names: BTreeSet<String>,
    pulled_ms: u64,
    last_used_ms: u64,
}

/// The ledger's file format (version 2): image id → what was pulled.
#[derive(Debug, Default, Serialize, Deserialize)]
struct LedgerFile {
    version: u32,
    images: BTreeMap<String, Pulled>,
    /// Names of a first-format ledger not resolved to an id yet.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    unresolved: BTreeMap<String, Seen>,
}

/// The first format (version 1): name → when.
#[derive(Debug, Deserialize)]
struct LedgerFileV1 {
    images: BTreeMap<String, Seen>,
}

/// Just the version, read first.
#[derive(Debug, Deserialize)]
struct Versioned {
    version: u32,
}

/// The images this shim pulled.
#[derive(Debug, Default)]
struct Ledger {
    /// By image id.
    images: BTreeMap<String, Pulled>,
    /// Names from a first-format ledger, not yet resolved to an id.
    unresolved: BTreeMap<String, Seen>,
    /// Changed since the last write.
    dirty: bool,
}

/// An image that may be removed: pulled by this shim, referred to by no task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// The image id.
    pub(crate) id: String,
    /// What to remove: its recorded names that still point to it, or its id when no name
    /// does.
    pub(crate) remove: Vec<String>,
    /// The names by digest it was pulled as (`repo@sha256:…`): a digest names one image for
    /// good, and the engine lists it as no tag, so a task naming one keeps the image.
    pub(crate) digests: Vec<String>,
    /// The engine's size (an upper bound of what removing it frees: the order only).
    pub(crate) size: u64,
    pub(crate) last_used_ms: u64,
}

/// How many bytes a pass must free: what takes the file system under `low` percent once it
/// is above `high` (nothing when `high` is 100 or more), and what a pull needs beyond what is
/// available (`need`).
pub(crate) fn bytes_to_free(usage: FsUsage, high: u8, low: u8, need: u64) -> u64 {
    let over = if high < 100 && usage.used_percent() > f64::from(high) {
        let target = usage.capacity as f64 * f64::from(low) / 100.0;
        (usage.used() as f64 - target).max(0.0).ceil() as u64
    } else {
        0
    };
    over.max(need.saturating_sub(usage.available))
}

/// The order in which candidates go: least recently used first (then the larger, then by
/// id, so the order is total).
pub(crate) fn removal_order(mut candidates: Vec<Candidate>) -> Vec<Candidate> {
    candidates.sort_by(|a, b| {
        a.last_used_ms
            .cmp(&b.last_used_ms)
            .then(b.size.cmp(&a.size))
            .then(a.id.cmp(&b.id))
    });
    candidates
}

/// What a recorded image is now, given the engine's names for it (`tags`, as the engine
/// spells them) and the names it was pulled as (`recorded`, normalised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Recorded names still point to it: removing them is this shim's to do (another name
    /// someone gave it stays, and with it the image).
    Named(Vec<String>),
    /// No name points to it any more (a later pull moved its tag): removed by id.
    Dangling,
    /// Only names this shim did not pull it as point to it: not this shim's any more.
    Foreign,
}

/// Judges a recorded image by the engine's names for it (see [`Standing`]).
pub(crate) fn standing(recorded: &BTreeSet<String>, tags: &[String]) -> Standing {
    if tags.is_empty() {
        return Standing::Dangling;
    }
    let ours: Vec<String> = tags
        .iter()
        .map(|t| normalize_reference(t))
        .filter(|t| recorded.contains(t))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if ours.is_empty() {
        Standing::Foreign
    } else {
        Standing::Named(ours)
    }
}

/// What a pass did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pass {
    /// The images removed (ids).
    pub(crate) removed: Vec<String>,
    /// What the file system got back, measured after each removal.
    pub(crate) freed: u64,
    /// The file system after the pass (`None`: unknown, no data root).
    pub(crate) usage: Option<FsUsage>,
}

/// The image collection room.
pub(crate) struct ImageGc {
    runtime: Arc<dyn ContainerRuntime>,
    table: Arc<TaskTable>,
    ledger_path: PathBuf,
    ledger: Mutex<Ledger>,
    /// The one writer of the ledger's file.
    writer: tokio::sync::Mutex<()>,
    high: u8,
    low: u8,
    /// One pass at a time.
    pass: tokio::sync::Mutex<()>,
    /// The names (normalized) of the image a pass is removing, marked from its last look at
    /// what tasks refer to (under this lock, so a task submitted later finds them here) until
    /// its removal ends: a pull step of one of them waits ([`ImageGc::presence`]), then finds
    /// the image gone and pulls it, instead of skipping the pull for an image about to vanish;
    /// a pull step of another image does not wait for a removal that takes minutes.
    removing: Mutex<BTreeSet<String>>,
    /// Told when a removal ends (its names unmarked).
    removal_ended: tokio::sync::Notify,
    /// The pulls out, by name ([`ImageGc::pulling`] to [`ImageGc::pull_ended`]).
    pulls_out: Mutex<BTreeMap<String, usize>>,
    /// The engine's data root, once known.
    data_root: Mutex<Option<Option<PathBuf>>>,
    freed_bytes: AtomicU64,
    removed_images: AtomicU64,
    no_room: AtomicU64,
    corrupt_ledgers: AtomicU64,
    /// The last usage seen: capacity and available bytes (0, 0: none yet).
    seen: Mutex<Option<FsUsage>>,
    /// What pulls and uses are stamped with in the ledger.
    clock: Clock,
    /// How the data root is measured.
    fs: Arc<dyn FsProbe>,
    /// Names seen present since the last image removal the engine reported, while its events
    /// are connected (see the module docs).
    present: Mutex<Present>,
}

/// Names seen present, trusted only while image removals would be heard of.
#[derive(Debug, Default)]
struct Present {
    /// The engine's event stream is connected: a removal would be reported.
    heard: bool,
    /// Normalised names.
    names: BTreeSet<String>,
}

/// The most names remembered as present (past it, the set starts over).
const MAX_PRESENT: usize = 256;

impl std::fmt::Debug for ImageGc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageGc")
            .field("high", &self.high)
            .field("low", &self.low)
            .finish_non_exhaustive()
    }
}

/// Why a pull cannot fit.
#[derive(Debug, Clone)]
pub(crate) struct NoRoom {
    pub(crate) need: u64,
    pub(crate) available: u64,
    pub(crate) removed: usize,
    pub(crate) freed: u64,
    pub(crate) data_root: PathBuf,
}

impl std::fmt::Display for NoRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the image does not fit: its layers need at least {} more, {} is available on the \
             file system of {} after removing {} unused image(s), which freed {}",
            human(self.need),
            human(self.available),
            self.data_root.display(),
            self.removed,
            human(self.freed),
        )
    }
}

/// Bytes in MiB with one decimal (or bytes below 1 MiB).
fn human(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{bytes} B")
    } else {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    }
}

/// The ledger read from `path`: `Ok(None)` when there is none, `Err(why)` when it cannot be
/// used (moved aside by the caller).
fn read_ledger(path: &Path) -> Result<Option<Ledger>, String> {
    let bytes = match fs_err::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let version = serde_json::from_slice::<Versioned>(&bytes)
        .map_err(|e| format!("not a ledger: {e}"))?
        .version;
    let mut ledger = Ledger::default();
    match version {
        1 => {
            ledger.unresolved = serde_json::from_slice::<LedgerFileV1>(&bytes)
                .map_err(|e| format!("version 1: {e}"))?
                .images
                .into_iter()
                .map(|(name, seen)| (normalize_reference(&name), seen))
                .collect();
            ledger.dirty = true;
        }
        LEDGER_VERSION => {
            let file = serde_json::from_slice::<LedgerFile>(&bytes)
                .map_err(|e| format!("version {LEDGER_VERSION}: {e}"))?;
            ledger.images = file.images;
            ledger.unresolved = file.unresolved;
        }
        other => {
            return Err(format!(
                "version {other}, this shim reads 1 and {LEDGER_VERSION}"
            ));
        }
    }
    Ok(Some(ledger))
}

impl ImageGc {
    /// The room on the ledger in `home`. Percentages: `high` 100 turns collection off; `low`
    /// is kept under `high`.
    pub(crate) fn open(
        runtime: Arc<dyn ContainerRuntime>,
        table: Arc<TaskTable>,
        home: &Path,
        high: u8,
        low: u8,
        clock: Clock,
        fs: Arc<dyn FsProbe>,
    ) -> Self {
        let ledger_path = home.join(LEDGER_FILE);
        match shim_fs::Dir::open(home).and_then(|d| d.remove_stale_temps(LEDGER_FILE)) {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %shim_util::error_chain(&e), "cannot remove the temp files of interrupted ledger writes");
            }
        }
        let mut corrupt = 0;
        let ledger = match read_ledger(&ledger_path) {
            Ok(ledger) => ledger.unwrap_or_default(),
            Err(why) => {
                corrupt = 1;
                let aside = home.join(format!("{LEDGER_FILE}.corrupt-{}", clock.now_ms()));
                match fs_err::rename(&ledger_path, &aside) {
                    Ok(()) => {
                        tracing::warn!(path = %ledger_path.display(), moved_to = %aside.display(), %why, "the image ledger cannot be read: kept aside; the images it lists are not collected (remove them by hand if they are unused)");
                    }
                    Err(e) => {
                        tracing::warn!(path = %ledger_path.display(), %why, error = %e, "the image ledger cannot be read nor moved aside; it is replaced at the next pull");
                    }
                }
                Ledger::default()
            }
        };
        Self {
            runtime,
            table,
            ledger_path,
            ledger: Mutex::new(ledger),
            writer: tokio::sync::Mutex::new(()),
            high: high.min(100),
            low: low.min(high.min(100)),
            pass: tokio::sync::Mutex::new(()),
            removing: Mutex::default(),
            removal_ended: tokio::sync::Notify::new(),
            pulls_out: Mutex::default(),
            data_root: Mutex::new(None),
            freed_bytes: AtomicU64::new(0),
            removed_images: AtomicU64::new(0),
            no_room: AtomicU64::new(0),
            corrupt_ledgers: AtomicU64::new(corrupt),
            seen: Mutex::new(None),
            clock,
            fs,
            present: Mutex::new(Present::default()),
        }
    }

    fn present(&self) -> MutexGuard<'_, Present> {
        self.present.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits while a pass removes `image` (see `removing`); a pull step asks before it
    /// decides whether its image is present. Its task refers to the image already (it is in
    /// the task table), so no pass starts removing it afterwards.
    pub(crate) async fn presence(&self, image: &str) {
        let mut wanted = Referenced::default();
        wanted.add(image);
        loop {
            let ended = self.removal_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if !self.removing_now().iter().any(|n| wanted.contains(n)) {
                return;
            }
            ended.await;
        }
    }

    fn removing_now(&self) -> MutexGuard<'_, BTreeSet<String>> {
        self.removing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `names` as being removed unless a task refers to one of them (checked under the
    /// same lock); the mark goes with the guard.
    fn mark_removing(&self, names: impl IntoIterator<Item = String>) -> Option<Removing<'_>> {
        let names: BTreeSet<String> = names.into_iter().collect();
        let mut removing = self.removing_now();
        let referenced = self.referenced();
        if names.iter().any(|n| referenced.contains(n)) {
            return None;
        }
        removing.extend(names.iter().cloned());
        Some(Removing { gc: self, names })
    }

    /// Whether `image` was seen present since the engine last reported an image removal
    /// (and its events are connected): the pull step need not ask.
    pub(crate) fn known_present(&self, image: &str) -> bool {
        let present = self.present();
        present.heard && present.names.contains(&normalize_reference(image))
    }

    /// `image` is present (the engine said so, or a pull made it): remembered while image
    /// removals are heard of.
    pub(crate) fn seen_present(&self, image: &str) {
        let mut present = self.present();
        if !present.heard {
            return;
        }
        if present.names.len() >= MAX_PRESENT {
            present.names.clear();
        }
        present.names.insert(normalize_reference(image));
    }

    /// The engine reported an image's removal (`name`: the name or id it names): any name
    /// seen present may be gone.
    pub(crate) fn image_removed(&self, name: &str) {
        tracing::debug!(image = %name, "the engine removed an image; images seen present are asked again");
        self.present().names.clear();
    }

    /// The engine reported a removal touching the image `id` (an untag or a deletion): if the
    /// ledger records it, the engine is asked whether it is still there, and a record of an
    /// image gone is forgotten at once (an operator's `docker image prune` would otherwise
    /// leave its records until a pass that needs space looked at them).
    pub(crate) fn image_id_removed(self: &Arc<Self>, id: &str) {
        let bare = |i: &str| i.strip_prefix("sha256:").unwrap_or(i).to_owned();
        let wanted = bare(id);
        let recorded = self
            .ledger()
            .images
            .keys()
            .find(|k| bare(k) == wanted)
            .cloned();
        let Some(recorded) = recorded else {
            return;
        };
        let room = Arc::clone(self);
        tokio::spawn(async move {
            if let Ok(None) = room.runtime.inspect_image(&recorded).await {
                tracing::debug!(image = %recorded, "a recorded image is gone: forgotten");
                room.forget(&recorded);
                room.save().await;
            }
        });
    }

    /// The engine's event stream connected (`true`) or was lost: what was seen present is
    /// forgotten either way (a removal may have gone unheard), and remembered again only
    /// while connected. A lost stream also forgets the engine's data root: the daemon may
    /// come back with another (an operator moving `data-root` to a bigger disk restarts
    /// Docker, not the shim).
    pub(crate) fn events_connected(&self, connected: bool) {
        {
            let mut present = self.present();
            present.heard = connected;
            present.names.clear();
        }
        if !connected {
            *self.data_root.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A pull of `image`, absent from the engine, begins: its name is recorded first, to be
    /// resolved to the image it names at a later pass (as a first-format ledger's names are),
    /// so that a shim killed between the pull's end and [`ImageGc::pulled`] still collects
    /// the image it pulled (the next start finds it present and does not pull it again).
    pub(crate) async fn pulling(&self, image: &str) {
        let name = normalize_reference(image);
        let now = self.clock.now_ms();
        *self.pulls_out().entry(name.clone()).or_insert(0) += 1;
        {
            let mut ledger = self.ledger();
            if ledger.unresolved.contains_key(&name) {
                return;
            }
            ledger.unresolved.insert(
                name,
                Seen {
                    pulled_ms: now,
                    last_used_ms: now,
                },
            );
            ledger.dirty = true;
        }
        self.save().await;
    }

    /// A pull announced by [`ImageGc::pulling`] ended (after [`ImageGc::pulled`] when it
    /// succeeded). A failed or cancelled one leaves no name behind: resolved later, it could
    /// name an image someone else pulled or loaded by hand.
    pub(crate) async fn pull_ended(&self, image: &str, succeeded: bool) {
        let name = normalize_reference(image);
        let last = {
            let mut out = self.pulls_out();
            match out.get_mut(&name) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                Some(_) => {
                    out.remove(&name);
                    true
                }
                None => false,
            }
        };
        if succeeded || !last {
            return;
        }
        let removed = {
            let mut ledger = self.ledger();
            let removed = ledger.unresolved.remove(&name).is_some();
            ledger.dirty |= removed;
            removed
        };
        if removed {
            self.save().await;
        }
    }

    fn pulls_out(&self) -> MutexGuard<'_, BTreeMap<String, usize>> {
        self.pulls_out.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A pull of `image` by this shim succeeded: the image its name now points to is
    /// recorded with that name (a candidate from now on, once no task refers to it); an image
    /// the name pointed to before keeps its record, without the name.
    pub(crate) async fn pulled(&self, image: &str) {
        let details = match self.runtime.inspect_image(image).await {
            Ok(Some(details)) => details,
            Ok(None) => {
                tracing::warn!(%image, "a pulled image is not there: not recorded");
                return;
            }
            Err(e) => {
                tracing::warn!(%image, error = %chain(&e), "cannot tell which image a pull produced: not recorded, never collected");
                return;
            }
        };
        let name = normalize_reference(image);
        let now = self.clock.now_ms();
        {
            let mut ledger = self.ledger();
            ledger.unresolved.remove(&name);
            for (id, pulled) in &mut ledger.images {
                if *id != details.id {
                    pulled.names.remove(&name);
                }
            }
            let pulled = ledger
                .images
                .entry(details.id.clone())
                .or_insert_with(|| Pulled {
                    names: BTreeSet::new(),
                    pulled_ms: now,
                    last_used_ms: now,
                });
            pulled.names.insert(name);
            pulled.pulled_ms = now;
            pulled.last_used_ms = now;
            ledger.dirty = true;
        }
        self.save().await;
    }

    /// A task is created from `image`: its last use (kept in memory, written with the
    /// ledger's next write).
    pub(crate) fn used(&self, image: &str) {
        let name = normalize_reference(image);
        let now = self.clock.now_ms();
        let mut ledger = self.ledger();
        let mut changed = false;
        for pulled in ledger.images.values_mut() {
            if pulled.names.contains(&name) {
                pulled.last_used_ms = now;
                changed = true;
            }
        }
        if let Some(seen) = ledger.unresolved.get_mut(&name) {
            seen.last_used_ms = now;
            changed = true;
        }
        ledger.dirty |= changed;
    }

    /// Writes the ledger if it changed: one write at a time, each with the ledger as it is
    /// once it may write (never an older snapshot over a newer one). A failure (a full disk)
    /// is logged; the ledger stays in memory and is written by a later pass.
    async fn save(&self) {
        let _writer = self.writer.lock().await;
        let bytes = {
            let mut ledger = self.ledger();
            if !ledger.dirty {
                return;
            }
            ledger.dirty = false;
            serde_json::to_vec_pretty(&LedgerFile {
                version: LEDGER_VERSION,
                images: ledger.images.clone(),
                unresolved: ledger.unresolved.clone(),
            })
        };
        let Ok(bytes) = bytes else { return };
        let path = self.ledger_path.clone();
        let written = tokio::task::spawn_blocking(move || {
            shim_fs::write_atomic(&path, &bytes, &shim_fs::WriteOptions::new(0o600))
        })
        .await;
        let failed = match written {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(shim_util::error_chain(&e)),
            Err(e) => Some(e.to_string()),
        };
        if let Some(error) = failed {
            tracing::warn!(path = %self.ledger_path.display(), %error, "cannot write the image ledger; retried later");
            self.ledger().dirty = true;
        }
    }

    /// The engine's data root, asked until the engine answers, then remembered (an engine
    /// that names none is not asked again: no request while idle).
    pub(crate) async fn data_root(&self) -> Option<PathBuf> {
        if let Some(known) = self
            .data_root
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return known;
        }
        match self.runtime.data_root().await {
            Ok(answer) => {
                if answer.is_none() {
                    tracing::info!("the engine names no data root: images are not collected");
                }
                *self.data_root.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer.clone());
                answer
            }
            Err(e) => {
                tracing::debug!(error = %chain(&e), "cannot ask the engine for its data root");
                None
            }
        }
    }

    /// A probe of the engine's data on disk (the used bytes of its data root's file system),
    /// which a pull watches while the engine unpacks in silence.
    pub(crate) async fn disk_probe(&self) -> Option<shim_runtime::DiskProbe> {
        let dir = self.data_root().await?;
        let fs = self.fs.clone();
        Some(shim_runtime::DiskProbe::new(move || {
            fs.usage(&dir).ok().map(|u| u.used())
        }))
    }

    /// How full the data root's file system is now (also remembered for the metrics).
    async fn usage(&self) -> Option<(PathBuf, FsUsage)> {
        let dir = self.data_root().await?;
        let (probe, fs) = (dir.clone(), self.fs.clone());
        let usage = tokio::task::spawn_blocking(move || fs.usage(&probe)).await;
        match usage {
            Ok(Ok(u)) => {
                *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(u);
                Some((dir, u))
            }
            Ok(Err(e)) => {
                tracing::warn!(dir = %dir.display(), error = %shim_util::error_chain(&e), "cannot measure the engine's data root");
                None
            }
            Err(_) => None,
        }
    }

    /// The images of every task this engine knows (any status, until it is removed).
    fn referenced(&self) -> Referenced {
        let mut referenced = Referenced::default();
        for slot in self.table.slots() {
            slot.read(|t| {
                if let Some(c) = &t.record().config {
                    referenced.add(&c.image_name);
                }
            });
        }
        referenced
    }

    /// Resolves the names not yet resolved (the first format's, and those of pulls that a stop
    /// of the shim cut off before their end was recorded) to the ids they point to now; a
    /// name whose pull is out waits for its end.
    async fn resolve_unresolved(&self) {
        let out: BTreeSet<String> = self.pulls_out().keys().cloned().collect();
        let names: Vec<(String, Seen)> = self
            .ledger()
            .unresolved
            .iter()
            .filter(|(n, _)| !out.contains(*n))
            .map(|(n, s)| (n.clone(), *s))
            .collect();
        for (name, seen) in names {
            let id = match self.runtime.inspect_image(&name).await {
                Ok(Some(details)) => Some(details.id),
                Ok(None) => None,
                Err(e) => {
                    tracing::debug!(image = %name, error = %chain(&e), "cannot resolve a name of the first ledger format yet");
                    continue;
                }
            };
            let mut ledger = self.ledger();
            ledger.unresolved.remove(&name);
            if let Some(id) = id {
                let pulled = ledger.images.entry(id).or_insert(Pulled {
                    names: BTreeSet::new(),
                    pulled_ms: seen.pulled_ms,
                    last_used_ms: seen.last_used_ms,
                });
                pulled.names.insert(name);
                pulled.last_used_ms = pulled.last_used_ms.max(seen.last_used_ms);
            }
            ledger.dirty = true;
        }
    }

    /// The recorded images no task refers to, as the engine knows them now; records of
    /// images gone or no longer this shim's are forgotten.
    async fn candidates(&self) -> Vec<Candidate> {
        let referenced = self.referenced();
        let listed: Vec<(String, Pulled)> = self
            .ledger()
            .images
            .iter()
            .map(|(id, p)| (id.clone(), p.clone()))
            .collect();
        let mut candidates = Vec::new();
        for (id, pulled) in listed {
            let details = match self.runtime.inspect_image(&id).await {
                Ok(Some(details)) => details,
                Ok(None) => {
                    // Gone (removed by hand, or pruned): nothing to collect, nothing to
                    // remember.
                    self.forget(&id);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(image = %id, error = %chain(&e), "cannot inspect an image; it is not collected in this pass");
                    continue;
                }
            };
            let digests: Vec<String> = (pulled.names.iter())
                .filter(|n| n.contains('@'))
                .cloned()
                .collect();
            // By any name it has now: its tags, its names by digest (which go with it: a task
            // may name an image by the digest of an image pulled by tag), and the digests
            // the ledger knows it by.
            let in_use = engine_names(&details).any(|n| referenced.contains(&n))
                || digests.iter().any(|d| referenced.contains(d))
                || referenced.contains(&id);
            let remove = match standing(&pulled.names, &details.tags) {
                Standing::Foreign => {
                    tracing::info!(image = %id, tags = ?details.tags, "an image this shim pulled is named only by names it did not pull it as: no longer collected");
                    self.forget(&id);
                    continue;
                }
                Standing::Dangling => vec![id.clone()],
                Standing::Named(names) => names,
            };
            if in_use {
                continue;
            }
            candidates.push(Candidate {
                id,
                remove,
                digests,
                size: details.size,
                last_used_ms: pulled.last_used_ms,
            });
        }
        candidates
    }

    fn forget(&self, id: &str) {
        let mut ledger = self.ledger();
        if ledger.images.remove(id).is_some() {
            ledger.dirty = true;
        }
    }

    /// Removes what `c` says; whether all of it went (a name or image in use by a container
    /// that is not a task's, or an engine error, keeps it).
    async fn remove(&self, c: &Candidate) -> bool {
        for target in &c.remove {
            match self.runtime.delete_image(target).await {
                Ok(()) => {}
                Err(RuntimeError::Conflict { message, .. }) => {
                    tracing::info!(image = %c.id, name = %target, %message, "an unused image is in use by a container that is not a task's, or named by another name; kept");
                    return false;
                }
                Err(e) => {
                    tracing::warn!(image = %c.id, name = %target, error = %chain(&e), "cannot remove an unused image");
                    return false;
                }
            }
        }
        true
    }

    /// A pass: frees what [`bytes_to_free`] asks (`need`: bytes a pull still needs), judged
    /// by the file system measured again after each removal.
    pub(crate) async fn collect(&self, need: u64) -> Pass {
        let one = self.pass.lock().await;
        self.run_pass(one, need).await
    }

    /// A pass, unless one is under way (it frees down to the low mark already): what a pull
    /// makes before it begins, which need not wait for another image's removal.
    pub(crate) async fn collect_unless_under_way(&self) -> Pass {
        match self.pass.try_lock() {
            Ok(one) => self.run_pass(one, 0).await,
            Err(_) => Pass::default(),
        }
    }

    /// [`ImageGc::collect`]'s work, `_one` held.
    async fn run_pass(&self, _one: tokio::sync::MutexGuard<'_, ()>, need: u64) -> Pass {
        let Some((dir, mut usage)) = self.usage().await else {
            return Pass::default();
        };
        let mut pass = Pass {
            usage: Some(usage),
            ..Pass::default()
        };
        let to_free = bytes_to_free(usage, self.high, self.low, need);
        if to_free == 0 || self.high >= 100 {
            self.save().await;
            return pass;
        }
        self.resolve_unresolved().await;
        let candidates = removal_order(self.candidates().await);
        for c in candidates {
            if bytes_to_free(usage, self.high, self.low, need) == 0 {
                break;
            }
            // Referred to since the list was made (a submit in between): kept. From here to
            // the removal's end no pull step of these names decides its image is present.
            let names = (c.remove.iter().chain(&c.digests)).chain([&c.id]).cloned();
            let Some(mut removing) = self.mark_removing(names) else {
                continue;
            };
            // Its names now (a pull may have tagged it again since the list: a removal by id
            // would take that name with it), marked too.
            match self.runtime.inspect_image(&c.id).await {
                Ok(Some(now)) => {
                    let Some(more) = self.mark_removing(engine_names(&now)) else {
                        continue;
                    };
                    removing.names.extend(more.take());
                }
                Ok(None) => {
                    self.forget(&c.id);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(image = %c.id, error = %chain(&e), "cannot inspect an image; it is not collected in this pass");
                    continue;
                }
            }
            for name in &c.remove {
                self.image_removed(name);
            }
            let removed = self.remove(&c).await;
            drop(removing);
            if !removed {
                continue;
            }
            self.forget(&c.id);
            let Some((_, after)) = self.usage().await else {
                break;
            };
            let freed = after.available.saturating_sub(usage.available);
            tracing::info!(image = %c.id, names = ?c.remove, engine_size = c.size, freed, "removed an unused image");
            pass.freed += freed;
            pass.removed.push(c.id.clone());
            usage = after;
        }
        self.freed_bytes.fetch_add(pass.freed, Ordering::Relaxed);
        self.removed_images
            .fetch_add(pass.removed.len() as u64, Ordering::Relaxed);
        if bytes_to_free(usage, self.high, self.low, need) > 0 {
            tracing::warn!(
                dir = %dir.display(),
                used_percent = usage.used_percent(),
                to_free,
                freed = pass.freed,
                "image collection could not free enough: every other image is in use or not the shim's"
            );
        } else if !pass.removed.is_empty() {
            tracing::info!(dir = %dir.display(), removed = pass.removed.len(), freed = pass.freed, used_percent = usage.used_percent(), "image collection done");
        }
        pass.usage = Some(usage);
        self.save().await;
        pass
    }

    /// A pull still needs `need` bytes: room is made for them if it is not there (a pass);
    /// `Err` when even that leaves too little, as measured.
    pub(crate) async fn make_room(&self, need: u64) -> Result<(), NoRoom> {
        let Some((dir, usage)) = self.usage().await else {
            return Ok(());
        };
        if need <= usage.available {
            return Ok(());
        }
        let pass = self.collect(need).await;
        let available = pass.usage.map_or(usage.available, |u| u.available);
        if need <= available {
            return Ok(());
        }
        self.no_room.fetch_add(1, Ordering::Relaxed);
        Err(NoRoom {
            need,
            available,
            removed: pass.removed.len(),
            freed: pass.freed,
            data_root: dir,
        })
    }

    /// Bytes freed by collection so far (measured on the file system).
    pub(crate) fn freed_bytes(&self) -> u64 {
        self.freed_bytes.load(Ordering::Relaxed)
    }

    /// Images removed by collection so far.
    pub(crate) fn removed_images(&self) -> u64 {
        self.removed_images.load(Ordering::Relaxed)
    }

    /// Pulls failed because the image could not fit.
    pub(crate) fn no_room_failures(&self) -> u64 {
        self.no_room.load(Ordering::Relaxed)
    }

    /// Ledgers found unreadable and moved aside (at start-up).
    pub(crate) fn corrupt_ledgers(&self) -> u64 {
        self.corrupt_ledgers.load(Ordering::Relaxed)
    }

    /// The data root's file system as last measured.
    pub(crate) fn last_usage(&self) -> Option<FsUsage> {
        *self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The background check: a pass every [`CHECK_EVERY`] until `shutdown`.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let room = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(CHECK_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = every.tick() => {}
                }
                let Some(room) = room.upgrade() else { return };
                room.collect(0).await;
            }
        })
    }
}

/// Names a pass is removing ([`ImageGc::mark_removing`]): unmarked, and the pull steps
/// waiting for them told, when dropped (the removal ended, or the pass was cut).
struct Removing<'a> {
    gc: &'a ImageGc,
    names: BTreeSet<String>,
}

impl Removing<'_> {
    /// The names, unmarked by the caller's own guard instead of this one.
    fn take(mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.names)
    }
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        if self.names.is_empty() {
            return;
        }
        let mut removing = self.gc.removing_now();
        for name in &self.names {
            removing.remove(name);
        }
        drop(removing);
        self.gc.removal_ended.notify_waiters();
    }
}

/// Every name the engine gives `details` now (tags and names by digest), normalized.
/// The images tasks name, in every form a name the engine gives an image, or its id, may
/// match: the normalised reference; for `repo:tag@digest`, which an engine resolves by the
/// digest alone, `repo@digest` too; and for a reference that may be an image id (`sha256:` and
/// hex, or hex alone, which Docker also takes as the start of an id), that start. A name that
/// only looks like an id keeps the images whose ids start so: collection errs on keeping.
#[derive(Debug, Default)]
struct Referenced {
    names: BTreeSet<String>,
    id_starts: Vec<String>,
}

impl Referenced {
    fn add(&mut self, image: &str) {
        let image = image.trim();
        let hex = image.strip_prefix("sha256:").unwrap_or(image);
        if is_hex_id(hex) {
            self.id_starts.push(hex.to_owned());
        }
        let name = normalize_reference(image);
        if let Some((named, digest)) = name.split_once('@') {
            let last = named.rfind('/').map_or(0, |i| i + 1);
            if let Some(colon) = named[last..].rfind(':') {
                self.names
                    .insert(format!("{}@{digest}", &named[..last + colon]));
            }
        }
        self.names.insert(name);
    }

    /// Whether a task names `name`: a normalised name of an image, or an image id.
    fn contains(&self, name: &str) -> bool {
        match name.strip_prefix("sha256:") {
            Some(hex) if is_hex_id(hex) => {
                self.id_starts.iter().any(|s| hex.starts_with(s.as_str()))
            }
            _ => self.names.contains(name),
        }
    }
}

/// Lowercase hex of an image id's length or less (not empty).
fn is_hex_id(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn engine_names(details: &ImageDetails) -> impl Iterator<Item = String> + '_ {
    (details.tags.iter())
        .chain(&details.digests)
        .map(|n| normalize_reference(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_reference_matches_the_engines_names_and_ids_it_resolves_to() {
        let d = format!("sha256:{}", "e".repeat(64));
        let id = format!("sha256:{}", "0123456789abcdef".repeat(4));
        let rows: [(&str, &str, bool); 9] = [
            ("app:1", "docker.io/library/app:1", true),
            ("app:1", "docker.io/library/app:2", false),
            ("reg:5000/app:1@D", "reg:5000/app@D", true),
            ("reg:5000/app:1@D", "reg:5000/app:1", false),
            ("localhost:5000/app@D", "localhost:5000/app@D", true),
            ("ID", "ID", true),
            ("0123456789ab", "ID", true),
            ("0123456789ac", "ID", false),
            ("cafe", "docker.io/library/cafe:latest", true),
        ];
        for (task, engine, holds) in rows {
            let mut r = Referenced::default();
            r.add(&task.replace("ID", &id).replace('D', &d));
            let engine = engine.replace("ID", &id).replace('D', &d);
            assert_eq!(r.contains(&engine), holds, "{task} holds {engine}");
        }
    }

    #[test]
    fn above_high_frees_down_to_low_and_below_high_nothing() {
        // 100 GiB, 90 used: down to 80 → 10 GiB.
        let usage = FsUsage::new(100 * GIB, 10 * GIB);
        assert_eq!(bytes_to_free(usage, 85, 80, 0), 10 * GIB);
        // 84 used: under high, nothing.
        assert_eq!(
            bytes_to_free(FsUsage::new(100 * GIB, 16 * GIB), 85, 80, 0),
            0
        );
        // Exactly at high: not above, nothing (kubelet: usage > high).
        assert_eq!(
            bytes_to_free(FsUsage::new(100 * GIB, 15 * GIB), 85, 80, 0),
            0
        );
        // high 100: collection is off, but a pull's need still counts.
        assert_eq!(bytes_to_free(usage, 100, 80, 0), 0);
        assert_eq!(bytes_to_free(usage, 100, 80, 12 * GIB), 2 * GIB);
        // A need beyond what is available, under high: just that.
        assert_eq!(
            bytes_to_free(FsUsage::new(100 * GIB, 16 * GIB), 85, 80, 20 * GIB),
            4 * GIB
        );
        // Both: the larger.
        assert_eq!(bytes_to_free(usage, 85, 80, 30 * GIB), 20 * GIB);
        // An empty capacity (unknown): nothing.
        assert_eq!(bytes_to_free(FsUsage::new(0, 0), 85, 80, 0), 0);
    }

    #[test]
    fn least_recently_used_go_first() {
        let c = |id: &str, size, last_used_ms| Candidate {
            id: id.into(),
            remove: vec![id.into()],
            digests: vec![],
            size,
            last_used_ms,
        };
        let order = removal_order(vec![
            c("b:1", 5, 300),
            c("a:1", 5, 100),
            c("big:1", 50, 200),
            c("small:1", 1, 200),
            c("z:1", 5, 100),
        ]);
        let names: Vec<&str> = order.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(names, ["a:1", "z:1", "big:1", "small:1", "b:1"]);
    }

    /// Issue 39: an id is this shim's to remove only through the names it pulled it as
    /// (compared normalised), or by id once no name points to it; names someone else gave it
    /// are never removed, and an image named only by them is not this shim's any more.
    #[test]
    fn an_image_is_collected_only_through_the_names_it_was_pulled_as() {
        let recorded = BTreeSet::from([normalize_reference("ubuntu:22.04")]);
        assert_eq!(
            standing(&recorded, &["docker.io/library/ubuntu:22.04".to_owned()]),
            Standing::Named(vec!["docker.io/library/ubuntu:22.04".to_owned()])
        );
        assert_eq!(
            standing(&recorded, &["ubuntu:22.04".to_owned(), "mine:1".to_owned()]),
            Standing::Named(vec!["docker.io/library/ubuntu:22.04".to_owned()]),
            "the operator's own name stays, and with it the image"
        );
        assert_eq!(standing(&recorded, &[]), Standing::Dangling);
        assert_eq!(
            standing(&recorded, &["mine:1".to_owned()]),
            Standing::Foreign
        );
    }

    #[test]
    fn no_room_says_what_in_numbers() {
        let e = NoRoom {
            need: 64 << 20,
            available: 10 << 20,
            removed: 1,
            freed: 12 << 20,
            data_root: "/var/lib/docker".into(),
        };
        assert_eq!(
            e.to_string(),
            "the image does not fit: its layers need at least 64.0 MiB more, 10.0 MiB is \
             available on the file system of /var/lib/docker after removing 1 unused image(s), \
             which freed 12.0 MiB"
        );
    }
}
