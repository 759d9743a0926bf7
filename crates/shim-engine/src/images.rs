//! Image garbage collection: the disk does not fill with images.
//!
//! Kubelet's thresholds and semantics: when the file system of the engine's data root is used
//! above `high` percent, images are removed, least recently used first, until it is used
//! below `low` percent. Only images this shim pulled are candidates (its ledger,
//! `<home>/images.json`, kept across restarts), and never one a task it knows refers to —
//! running, starting, pulling, or terminated and not yet removed (a task the server may still
//! restart or inspect); the engine itself refuses to remove an image any container uses (the
//! removal is never forced), which covers containers that are not this shim's.
//!
//! A pass runs before each pull, after each pull, and every [`CHECK_EVERY`]; a pull whose
//! remaining bytes (the layers' sizes as the progress stream announces them, compressed, so
//! a lower bound of what it needs) exceed what the file system has left asks for a pass that
//! frees that much, and fails at once when even that cannot make room
//! ([`ImageGc::make_room`]). `high` = 100 turns collection off; the fit check stays.
//!
//! The room owns the ledger and the policy; the effects tell it what was pulled and used.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shim_resources::host::{FsProbe, FsUsage};
use shim_runtime::{ContainerRuntime, RuntimeError};

use crate::clock::Clock;
use crate::error::chain;
use crate::table::TaskTable;

/// How often the background check looks at the file system.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(60);

/// The ledger's file in the home.
const LEDGER_FILE: &str = "images.json";

/// When an image was pulled by this shim and last used by a task (Unix ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Seen {
    pulled_ms: u64,
    last_used_ms: u64,
}

/// The ledger's file format.
#[derive(Debug, Default, Serialize, Deserialize)]
struct LedgerFile {
    version: u32,
    images: BTreeMap<String, Seen>,
}

/// The images this shim pulled.
#[derive(Debug, Default)]
struct Ledger {
    images: BTreeMap<String, Seen>,
    /// Changed since the last write.
    dirty: bool,
}

/// An image that may be removed: pulled by this shim, referred to by no task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) image: String,
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
/// name, so the order is total).
pub(crate) fn removal_order(mut candidates: Vec<Candidate>) -> Vec<Candidate> {
    candidates.sort_by(|a, b| {
        a.last_used_ms
            .cmp(&b.last_used_ms)
            .then(b.size.cmp(&a.size))
            .then(a.image.cmp(&b.image))
    });
    candidates
}

/// What a pass did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pass {
    /// The images removed.
    pub(crate) removed: Vec<String>,
    /// Their sizes together, as the engine reported them.
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
    high: u8,
    low: u8,
    /// One pass at a time.
    pass: tokio::sync::Mutex<()>,
    /// The engine's data root, once known.
    data_root: Mutex<Option<Option<PathBuf>>>,
    freed_bytes: AtomicU64,
    removed_images: AtomicU64,
    no_room: AtomicU64,
    /// The last usage seen: capacity and available bytes (0, 0: none yet).
    seen: Mutex<Option<FsUsage>>,
    /// What pulls and uses are stamped with in the ledger.
    clock: Clock,
    /// How the data root is measured.
    fs: Arc<dyn FsProbe>,
}

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
             file system of {} after removing {} unused image(s) of {}",
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

impl ImageGc {
    /// The room on the ledger in `home`. Percentages: `high` 100 turns collection off; `low`
    /// is kept under `high`.
    pub(crate) fn open(
        runtime: Arc<dyn ContainerRuntime>,
        table: Arc<TaskTable>,
        home: &std::path::Path,
        high: u8,
        low: u8,
        clock: Clock,
        fs: Arc<dyn FsProbe>,
    ) -> Self {
        let ledger_path = home.join(LEDGER_FILE);
        let images = match fs_err::read(&ledger_path) {
            Ok(bytes) => match serde_json::from_slice::<LedgerFile>(&bytes) {
                Ok(file) => file.images,
                Err(e) => {
                    tracing::warn!(path = %ledger_path.display(), error = %e, "the image ledger cannot be read; no image pulled before is collected");
                    BTreeMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                tracing::warn!(error = %e, "the image ledger cannot be read; no image pulled before is collected");
                BTreeMap::new()
            }
        };
        Self {
            runtime,
            table,
            ledger_path,
            ledger: Mutex::new(Ledger {
                images,
                dirty: false,
            }),
            high: high.min(100),
            low: low.min(high.min(100)),
            pass: tokio::sync::Mutex::new(()),
            data_root: Mutex::new(None),
            freed_bytes: AtomicU64::new(0),
            removed_images: AtomicU64::new(0),
            no_room: AtomicU64::new(0),
            seen: Mutex::new(None),
            clock,
            fs,
        }
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `image` was pulled by this shim: a candidate from now on (once no task refers to it).
    pub(crate) async fn pulled(&self, image: &str) {
        let now = self.clock.now_ms();
        {
            let mut ledger = self.ledger();
            let seen = ledger.images.entry(image.to_owned()).or_insert(Seen {
                pulled_ms: now,
                last_used_ms: now,
            });
            seen.pulled_ms = now;
            seen.last_used_ms = now;
            ledger.dirty = true;
        }
        self.save().await;
    }

    /// A task is created from `image`: its last use (kept in memory, written with the
    /// ledger's next write).
    pub(crate) fn used(&self, image: &str) {
        let mut ledger = self.ledger();
        if let Some(seen) = ledger.images.get_mut(image) {
            seen.last_used_ms = self.clock.now_ms();
            ledger.dirty = true;
        }
    }

    /// Writes the ledger if it changed. A failure (a full disk) is logged; the ledger stays
    /// in memory and is written by a later pass.
    async fn save(&self) {
        let bytes = {
            let mut ledger = self.ledger();
            if !ledger.dirty {
                return;
            }
            ledger.dirty = false;
            serde_json::to_vec_pretty(&LedgerFile {
                version: 1,
                images: ledger.images.clone(),
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
    async fn data_root(&self) -> Option<PathBuf> {
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
    fn referenced(&self) -> BTreeSet<String> {
        self.table
            .slots()
            .iter()
            .filter_map(|slot| {
                slot.read(|t| {
                    t.record()
                        .config
                        .as_ref()
                        .map(|c| shim_runtime::with_default_tag(&c.image_name))
                })
            })
            .collect()
    }

    /// A pass: frees what [`bytes_to_free`] asks (`need`: bytes a pull still needs).
    pub(crate) async fn collect(&self, need: u64) -> Pass {
        let _one = self.pass.lock().await;
        let Some((dir, usage)) = self.usage().await else {
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
        let referenced = self.referenced();
        let listed: Vec<(String, Seen)> = self
            .ledger()
            .images
            .iter()
            .filter(|(image, _)| !referenced.contains(*image))
            .map(|(i, s)| (i.clone(), *s))
            .collect();
        let mut candidates = Vec::new();
        for (image, seen) in listed {
            match self.runtime.image_size(&image).await {
                Ok(Some(size)) => candidates.push(Candidate {
                    image,
                    size,
                    last_used_ms: seen.last_used_ms,
                }),
                Ok(None) => {
                    // Gone (removed by hand): nothing to collect, nothing to remember.
                    let mut ledger = self.ledger();
                    ledger.images.remove(&image);
                    ledger.dirty = true;
                }
                Err(e) => {
                    tracing::warn!(%image, error = %chain(&e), "cannot size an image; it is not collected in this pass");
                }
            }
        }
        for c in removal_order(candidates) {
            if pass.freed >= to_free {
                break;
            }
            // Referred to since the list was made (a submit in between): kept.
            if self.referenced().contains(&c.image) {
                continue;
            }
            match self.runtime.delete_image(&c.image).await {
                Ok(()) => {
                    tracing::info!(image = %c.image, size = c.size, "removed an unused image");
                    pass.freed += c.size;
                    pass.removed.push(c.image.clone());
                    let mut ledger = self.ledger();
                    ledger.images.remove(&c.image);
                    ledger.dirty = true;
                }
                Err(RuntimeError::Conflict { message, .. }) => {
                    tracing::info!(image = %c.image, %message, "an unused image is in use by a container that is not a task's; kept");
                }
                Err(e) => {
                    tracing::warn!(image = %c.image, error = %chain(&e), "cannot remove an unused image");
                }
            }
        }
        self.freed_bytes.fetch_add(pass.freed, Ordering::Relaxed);
        self.removed_images
            .fetch_add(pass.removed.len() as u64, Ordering::Relaxed);
        let after = self.usage().await.map(|(_, u)| u);
        if pass.freed < to_free {
            tracing::warn!(
                dir = %dir.display(),
                used_percent = after.map(|u| u.used_percent()),
                to_free,
                freed = pass.freed,
                "image collection could not free enough: every other image is in use or not the shim's"
            );
        } else if !pass.removed.is_empty() {
            tracing::info!(dir = %dir.display(), removed = pass.removed.len(), freed = pass.freed, used_percent = after.map(|u| u.used_percent()), "image collection done");
        }
        pass.usage = after.or(pass.usage);
        self.save().await;
        pass
    }

    /// A pull still needs `need` bytes: room is made for them if it is not there (a pass);
    /// `Err` when even that leaves too little.
    pub(crate) async fn make_room(&self, need: u64) -> Result<(), NoRoom> {
        let Some((dir, usage)) = self.usage().await else {
            return Ok(());
        };
        if need <= usage.available {
            return Ok(());
        }
        let pass = self.collect(need).await;
        let available = pass.usage.map_or(usage.available, |u| u.available);
        // The engine reports what it freed; the file system may take a moment to show it.
        if need <= available.max(usage.available.saturating_add(pass.freed)) {
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

    /// Bytes freed by collection so far (the engine's sizes of the images removed).
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

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

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
        let c = |image: &str, size, last_used_ms| Candidate {
            image: image.into(),
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
        let names: Vec<&str> = order.iter().map(|c| c.image.as_str()).collect();
        assert_eq!(names, ["a:1", "z:1", "big:1", "small:1", "b:1"]);
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
             available on the file system of /var/lib/docker after removing 1 unused image(s) \
             of 12.0 MiB"
        );
    }
}
