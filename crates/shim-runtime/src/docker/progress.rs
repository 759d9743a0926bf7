//! Pull progress: the daemon's per-layer messages folded into [`PullProgress`], and the
//! pull log.

use std::collections::BTreeMap;
use std::path::Path;

use bollard::models::CreateImageInfo;
use tokio::io::AsyncWriteExt;
use tracing::warn;

use crate::types::PullProgress;
use crate::{Result, RuntimeError};

/// One layer's progress.
#[derive(Debug, Default, Clone, Copy)]
struct Layer {
    total: Option<u64>,
    downloaded: u64,
    extracted: u64,
    done: bool,
}

/// Folds the daemon's per-layer pull messages into [`PullProgress`].
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
            "Extracting" => {
                if let Some(t) = total {
                    layer.total = Some(layer.total.map_or(t, |old| old.max(t)));
                    layer.downloaded = layer.downloaded.max(t);
                }
                if let Some(c) = current {
                    layer.extracted = c;
                }
            }
            "Pull complete" => {
                layer.done = true;
                if let Some(t) = layer.total {
                    layer.downloaded = t;
                    layer.extracted = t;
                }
            }
            "Already exists" => {
                layer.done = true;
                layer.total.get_or_insert(0);
            }
            _ => {}
        }
        is_new || before != (layer.total, layer.downloaded, layer.extracted, layer.done)
    }

    /// The folded progress.
    pub(crate) fn progress(&self, finished: bool) -> PullProgress {
        let mut p = PullProgress::default();
        let mut all_known = !self.layers.is_empty();
        for layer in self.layers.values() {
            p.downloaded_bytes += layer.downloaded;
            p.extracted_bytes += layer.extracted;
            match layer.total {
                Some(t) => p.total_bytes += t,
                None => all_known &= layer.done,
            }
        }
        p.is_total_bytes_final = finished || all_known;
        p
    }
}

/// Writes the pull's progress messages as JSON lines.
pub(super) struct PullLog {
    path: std::path::PathBuf,
    out: tokio::io::BufWriter<tokio::fs::File>,
}

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
        })
    }

    pub(super) async fn write(&mut self, info: &CreateImageInfo) -> Result<()> {
        let mut line = serde_json::to_vec(info).map_err(|e| RuntimeError::PullLog {
            path: self.path.clone(),
            source: e.into(),
        })?;
        line.push(b'\n');
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
}
