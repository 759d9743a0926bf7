//! Pull progress: the daemon's per-layer messages folded into [`PullProgress`], and the
//! pull log.
//!
//! `PullProgress` is summed over the image's layers: shim-task's type, the one the task view
//! shows (one definition; shim-task is the pure leaf every shim crate may depend on). Its four
//! fields are upstream's `image_pull_progress`, and nothing else is said on the wire.
//!
//! What the Docker runtime puts in it: layers already on the host before the pull count 0;
//! bytes come only from byte counts (an engine's count in other units is ignored);
//! `downloaded_bytes` and `total_bytes` from `Downloading` (every engine counts it in bytes);
//! `extracted_bytes` from what the engine reports of extraction, which differs:
//!
//! - Docker, classic image store: `Extracting` counts bytes, layer by layer.
//! - Docker 28+, containerd image store: `Extracting` counts seconds (`"units":"s"`), which
//!   are ignored; a layer counts as extracted, whole, at its `Pull complete` (upstream does the
//!   same, dstackai/dstack#3921).
//! - Docker 26–27 with the containerd image store, and Podman: no extraction is reported, so
//!   `extracted_bytes` stays 0 while the pull runs.
//!
//! The final progress of a pull that succeeded has `extracted_bytes` = `downloaded_bytes` =
//! `total_bytes` and `is_total_bytes_final` set, on every engine: the engine answers a pull
//! once the image is unpacked, so a finished pull never reads "0 of N extracted".

use std::collections::BTreeMap;
use std::path::Path;

use bollard::models::CreateImageInfo;
use tokio::io::AsyncWriteExt;
use tracing::warn;

use crate::{Result, RuntimeError};
use shim_task::PullProgress;

/// One layer's progress.
#[derive(Debug, Default, Clone, Copy)]
struct Layer {
    total: Option<u64>,
    downloaded: u64,
    extracted: u64,
    done: bool,
    /// Its download is over (a status after `Downloading`).
    fetched: bool,
}

/// Folds the daemon's per-layer pull messages into [`PullProgress`], by the rules written on
/// [`PullProgress`] (crate::types).
///
/// Bytes come only from byte counts. Moby's progress detail has a `units` field (empty means
/// bytes: api/types/jsonstream/progress.go), which bollard's `ProgressDetail` drops; what is
/// left tells the same apart: the one non-byte count any engine sends is the containerd image
/// store's `Extracting` in seconds, `{"current":N,"units":"s"}` and never a total (moby v28
/// daemon/containerd/progress.go), where a byte `Extracting` (classic store,
/// distribution/pull_v2.go) always carries its layer's size as total. So an `Extracting`
/// without a total is not bytes, and is not counted (upstream dstack ignores it likewise:
/// runner/internal/shim/docker.go, `isUnitBytes`, dstackai/dstack#3921).
#[derive(Debug, Default)]
pub(crate) struct ProgressFolder {
    layers: BTreeMap<String, Layer>,
}

impl ProgressFolder {
    /// Feeds one message; returns whether the progress changed.
    pub(crate) fn feed(&mut self, info: &CreateImageInfo) -> bool {
        let (Some(id), Some(status)) = (info.id.as_deref(), info.status.as_deref()) else {
            return false;
        };
        let detail = info.progress_detail.as_ref();
        let current = detail
            .and_then(|d| d.current)
            .and_then(|c| u64::try_from(c).ok());
        let total = detail
            .and_then(|d| d.total)
            .and_then(|t| u64::try_from(t).ok())
            .filter(|t| *t > 0);
        let layer_status = matches!(
            status,
            "Pulling fs layer"
                | "Waiting"
                | "Downloading"
                | "Verifying Checksum"
                | "Download complete"
                | "Extracting"
                | "Pull complete"
                | "Already exists"
        );
        if !layer_status {
            return false;
        }
        let is_new = !self.layers.contains_key(id);
        let layer = self.layers.entry(id.to_owned()).or_default();
        let before = (layer.total, layer.downloaded, layer.extracted, layer.done);
        layer.fetched |= matches!(
            status,
            "Verifying Checksum"
                | "Download complete"
                | "Extracting"
                | "Pull complete"
                | "Already exists"
        );
        match status {
            "Downloading" => {
                if let Some(t) = total {
                    layer.total = Some(t);
                }
                if let Some(c) = current {
                    layer.downloaded = c;
                }
            }
            "Verifying Checksum" | "Download complete" => {
                if let Some(t) = layer.total {
                    layer.downloaded = t;
                }
            }
            "Extracting" => match total {
                // Bytes, with the layer's size as total.
                Some(t) => {
                    layer.total = Some(layer.total.map_or(t, |old| old.max(t)));
                    layer.downloaded = layer.downloaded.max(t);
                    if let Some(c) = current {
                        layer.extracted = c;
                    }
                }
                // Not bytes (seconds, on the containerd store): the count is ignored, but
                // the layer's download is over.
                None => {
                    if let Some(t) = layer.total {
                        layer.downloaded = layer.downloaded.max(t);
                    }
                }
            },
            "Pull complete" => {
                layer.done = true;
                if let Some(t) = layer.total {
                    layer.downloaded = t;
                }
                layer.extracted = layer.downloaded;
            }
            "Already exists" => {
                layer.done = true;
                layer.total.get_or_insert(0);
            }
            _ => {}
        }
        is_new || before != (layer.total, layer.downloaded, layer.extracted, layer.done)
    }

    /// Whether every layer announced so far is downloaded (at least one was): what is left
    /// is unpacking, which some engines do in silence.
    pub(crate) fn downloads_complete(&self) -> bool {
        !self.layers.is_empty() && self.layers.values().all(|l| l.fetched)
    }

    /// The folded progress; `finished`: of a pull that succeeded, where every layer is
    /// downloaded and extracted (the engine answers a pull once the image is unpacked), also
    /// on engines that never report extraction.
    pub(crate) fn progress(&self, finished: bool) -> PullProgress {
        let mut p = PullProgress::default();
        let mut all_known = !self.layers.is_empty();
        for layer in self.layers.values() {
            let (downloaded, extracted) = if finished {
                let all = layer.downloaded.max(layer.total.unwrap_or(0));
                (all, all)
            } else {
                (layer.downloaded, layer.extracted)
            };
            p.downloaded_bytes += downloaded;
            p.extracted_bytes += extracted;
            match layer.total {
                Some(t) => p.total_bytes += t,
                None => all_known &= layer.done,
            }
        }
        p.is_total_bytes_final = finished || all_known;
        p
    }
}

/// Tells the engine's pull messages that say something new (activity, for the stall
/// watchdog) from repeats. Docker 28 on the containerd image store repeats each layer's last
/// line every 100 ms while nothing arrives (`Downloading` with the same count, a stalled
/// download included), so a message counts only if it differs from the last one about the
/// same layer (status, count or total): a count that grew, a layer's new status (`Verifying
/// Checksum`, `Extracting`, `Pull complete`…), the containerd store's extraction seconds.
/// Messages about no layer (`Pulling from …`, `Digest: …`) count if they differ from the last
/// such message.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    /// By layer id (`None`: about no layer), what the last message said.
    last: BTreeMap<Option<String>, Said>,
}

/// What one message says: its status, count and total.
type Said = (Option<String>, Option<i64>, Option<i64>);

impl Activity {
    /// Whether `info` says something new.
    pub(crate) fn is_new(&mut self, info: &CreateImageInfo) -> bool {
        let detail = info.progress_detail.as_ref();
        let said = (
            info.status.clone(),
            detail.and_then(|d| d.current),
            detail.and_then(|d| d.total),
        );
        let previous = self.last.insert(info.id.clone(), said.clone());
        previous.as_ref() != Some(&said)
    }
}

/// Writes the pull's progress messages as JSON lines, at most [`PULL_LOG_MAX_BYTES`] (a pull
/// that trickles for days, each count a line, does not fill the home); the caller leaves out
/// the engine's repeats.
pub(super) struct PullLog {
    path: std::path::PathBuf,
    out: tokio::io::BufWriter<tokio::fs::File>,
    written: usize,
}

/// The most bytes of one pull's log.
pub(super) const PULL_LOG_MAX_BYTES: usize = 16 << 20;

/// The last line of a pull log that reached [`PULL_LOG_MAX_BYTES`].
const PULL_LOG_FULL: &[u8] =
    b"{\"status\":\"(the rest of this pull's messages are not logged: the log is full)\"}\n";

impl PullLog {
    pub(super) async fn create(path: &Path) -> Result<Self> {
        let file = tokio::fs::File::create(path)
            .await
            .map_err(|source| RuntimeError::PullLog {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            path: path.to_owned(),
            out: tokio::io::BufWriter::new(file),
            written: 0,
        })
    }

    pub(super) async fn write(&mut self, info: &CreateImageInfo) -> Result<()> {
        if self.written >= PULL_LOG_MAX_BYTES {
            return Ok(());
        }
        let mut line = serde_json::to_vec(info).map_err(|e| RuntimeError::PullLog {
            path: self.path.clone(),
            source: e.into(),
        })?;
        line.push(b'\n');
        self.written += line.len();
        if self.written >= PULL_LOG_MAX_BYTES {
            line = PULL_LOG_FULL.to_vec();
        }
        self.out
            .write_all(&line)
            .await
            .map_err(|source| RuntimeError::PullLog {
                path: self.path.clone(),
                source,
            })
    }

    pub(super) async fn finish(mut self) {
        if let Err(err) = self.out.flush().await {
            warn!(path = %self.path.display(), %err, "cannot flush pull log");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::ProgressDetail;

    fn msg(id: &str, status: &str, current: Option<i64>, total: Option<i64>) -> CreateImageInfo {
        CreateImageInfo {
            id: Some(id.to_owned()),
            status: Some(status.to_owned()),
            progress_detail: Some(ProgressDetail { current, total }),
            ..CreateImageInfo::default()
        }
    }

    /// Docker 28's repeats during a stall are not activity; a grown count, a new status, the
    /// next extraction second, and a new layer are.
    #[test]
    fn only_new_messages_are_activity() {
        let mut a = Activity::default();
        let down = |n| msg("l1", "Downloading", Some(n), Some(8 << 20));
        assert!(a.is_new(&down(1 << 20)));
        for _ in 0..50 {
            assert!(!a.is_new(&down(1 << 20)), "a repeat");
        }
        assert!(a.is_new(&down(2 << 20)));
        assert!(a.is_new(&msg("l2", "Downloading", Some(1 << 20), Some(4 << 20))));
        assert!(!a.is_new(&down(2 << 20)), "l1's last line, after l2's");
        assert!(a.is_new(&msg("l1", "Download complete", None, None)));
        assert!(a.is_new(&msg("l1", "Extracting", Some(1), None)));
        assert!(!a.is_new(&msg("l1", "Extracting", Some(1), None)));
        assert!(a.is_new(&msg("l1", "Extracting", Some(2), None)));
        assert!(a.is_new(&msg("l1", "Pull complete", None, None)));
        let about_none = |status: &str| CreateImageInfo {
            status: Some(status.to_owned()),
            ..CreateImageInfo::default()
        };
        assert!(a.is_new(&about_none("Pulling from x")));
        assert!(!a.is_new(&about_none("Pulling from x")));
        assert!(a.is_new(&about_none("Digest: sha256:0")));
    }

    /// The silent phase begins when every layer announced is downloaded, whatever the engine
    /// says next (Podman and Docker 26's containerd store: nothing; classic: extraction).
    #[test]
    fn downloads_complete_once_every_layer_is_downloaded() {
        let mut f = ProgressFolder::default();
        assert!(!f.downloads_complete(), "no layer yet");
        f.feed(&msg("a", "Pulling fs layer", None, None));
        f.feed(&msg("b", "Already exists", None, None));
        assert!(!f.downloads_complete());
        f.feed(&msg("a", "Downloading", Some(10), Some(20)));
        assert!(!f.downloads_complete());
        f.feed(&msg("a", "Download complete", None, None));
        assert!(f.downloads_complete());
        f.feed(&msg("c", "Waiting", None, None));
        assert!(!f.downloads_complete(), "a layer announced later");
        f.feed(&msg("c", "Extracting", Some(1), None));
        assert!(f.downloads_complete());
    }

    #[test]
    fn progress_folds_layers() {
        let mut f = ProgressFolder::default();
        assert!(!f.progress(false).is_total_bytes_final);
        assert!(!f.feed(&CreateImageInfo {
            status: Some("Pulling from x".to_owned()),
            id: Some("1".to_owned()),
            ..CreateImageInfo::default()
        }));
        assert!(f.feed(&msg("a", "Pulling fs layer", None, None)));
        assert!(f.feed(&msg("b", "Pulling fs layer", None, None)));
        assert!(f.feed(&msg("c", "Already exists", None, None)));
        assert!(f.feed(&msg("a", "Downloading", Some(10), Some(100))));
        let p = f.progress(false);
        assert_eq!((p.downloaded_bytes, p.total_bytes), (10, 100));
        assert!(!p.is_total_bytes_final, "layer b has no size yet");
        assert!(f.feed(&msg("b", "Downloading", Some(5), Some(50))));
        let p = f.progress(false);
        assert_eq!((p.downloaded_bytes, p.total_bytes), (15, 150));
        assert!(p.is_total_bytes_final);
        f.feed(&msg("a", "Download complete", None, None));
        f.feed(&msg("a", "Extracting", Some(40), Some(100)));
        let p = f.progress(false);
        assert_eq!((p.downloaded_bytes, p.extracted_bytes), (105, 40));
        f.feed(&msg("a", "Pull complete", None, None));
        f.feed(&msg("b", "Pull complete", None, None));
        let p = f.progress(true);
        assert_eq!(
            p,
            PullProgress {
                downloaded_bytes: 150,
                extracted_bytes: 150,
                total_bytes: 150,
                is_total_bytes_final: true
            }
        );
    }

    /// Feeds an engine's pull answer (JSON lines, read by bollard's model as the real stream
    /// is) and returns the progress after every change, then the final progress of the
    /// finished pull. Every step has no more extracted than downloaded.
    fn fold(fixture: &str) -> (Vec<PullProgress>, PullProgress) {
        let mut f = ProgressFolder::default();
        let mut steps = Vec::new();
        for line in fixture.lines() {
            let info: CreateImageInfo = serde_json::from_str(line).unwrap();
            if f.feed(&info) {
                let p = f.progress(false);
                assert!(p.extracted_bytes <= p.downloaded_bytes, "{line}: {p:?}");
                steps.push(p);
            }
        }
        (steps, f.progress(true))
    }

    fn bytes(p: &PullProgress) -> (u64, u64, u64) {
        (p.extracted_bytes, p.downloaded_bytes, p.total_bytes)
    }

    const ALL: PullProgress = PullProgress {
        downloaded_bytes: 3000,
        extracted_bytes: 3000,
        total_bytes: 3000,
        is_total_bytes_final: true,
    };

    /// Docker's classic image store: `Extracting` in bytes, with the layer's size as total.
    #[test]
    fn classic_store_extracts_in_bytes() {
        let (steps, done) = fold(include_str!("fixtures/pull-docker-20.10-classic.jsonl"));
        assert!(
            steps.iter().any(|p| bytes(p) == (400, 1000, 1000)),
            "{steps:?}"
        );
        assert_eq!(steps.last().map(bytes), Some((3000, 3000, 3000)));
        assert_eq!(done, ALL);
    }

    /// Docker 28's containerd image store counts `Extracting` in seconds
    /// (`{"current":3,"units":"s"}`, no total): never bytes. A layer counts as extracted,
    /// whole, at its `Pull complete`. Upstream does the same: dstackai/dstack#3921,
    /// runner/internal/shim/docker_test.go, `TestPullTracker_NonBytesExtractingUnit`.
    #[test]
    fn containerd_store_seconds_are_not_bytes() {
        let (steps, done) = fold(include_str!("fixtures/pull-docker-28-containerd.jsonl"));
        let seen: Vec<_> = steps.iter().map(bytes).collect();
        // The seconds (1, 3, then 1, 9) change nothing: extracted moves by whole layers only,
        // layer a's 1000 bytes at its `Pull complete`, then b's 2000 at its own.
        assert_eq!(
            seen,
            [
                (0, 0, 0),
                (0, 0, 0),
                (0, 500, 1000),
                (0, 2000, 3000),
                (0, 2500, 3000),
                (0, 3000, 3000),
                (1000, 3000, 3000),
                (3000, 3000, 3000),
            ]
        );
        assert_eq!(done, ALL);
    }

    /// Docker 26's containerd image store reports no extraction at all (no `Extracting`, no
    /// `Pull complete`), nor does Podman's compat API: extracted stays 0 while the pull runs,
    /// and the finished pull says everything it downloaded is extracted (not "0 of N").
    #[test]
    fn engines_without_extraction_reports_end_extracted() {
        for fixture in [
            include_str!("fixtures/pull-docker-26-containerd.jsonl"),
            include_str!("fixtures/pull-podman-4.3.jsonl"),
        ] {
            let (steps, done) = fold(fixture);
            assert!(steps.iter().all(|p| p.extracted_bytes == 0), "{steps:?}");
            let last = steps.last().unwrap();
            assert_eq!(
                (last.downloaded_bytes, last.total_bytes),
                (3000, 3000),
                "{steps:?}"
            );
            assert_eq!(done, ALL);
        }
    }
}
