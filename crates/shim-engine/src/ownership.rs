//! The ownership rule applied (SPEC §5, [`crate::labels`]): which containers of a list are this
//! engine's. Most are decided as their runner mount is spelled; the rest need links resolved,
//! which reads the file system, so it runs off the async workers.

use std::path::{Path, PathBuf};

use shim_runtime::{ContainerSummary, MountPoint};

use crate::error::{Result, chain};
use crate::labels::{TaskRoots, is_ours, is_ours_lexically, runner_mount};

/// This home's task roots, and the decisions made with them.
#[derive(Debug, Clone)]
pub(crate) struct Ownership {
    roots: TaskRoots,
}

impl Ownership {
    /// The ownership rule of `home` (resolves its links off the async workers).
    pub(crate) async fn of_home(home: &Path) -> Result<Self> {
        let home = home.to_path_buf();
        let roots = tokio::task::spawn_blocking(move || TaskRoots::of_home(&home)).await?;
        Ok(Self { roots })
    }

    /// The containers of `containers` that are this engine's.
    pub(crate) async fn ours(&self, containers: Vec<ContainerSummary>) -> Vec<ContainerSummary> {
        let mut ours = Vec::new();
        let mut unsure = Vec::new();
        for c in containers {
            match is_ours_lexically(&c.mounts, &self.roots) {
                Some(true) => ours.push(c),
                Some(false) => {}
                None => unsure.push(c),
            }
        }
        if !unsure.is_empty() {
            let roots = self.roots.clone();
            let resolved = tokio::task::spawn_blocking(move || {
                unsure
                    .into_iter()
                    .filter(|c| is_ours(&c.mounts, &roots))
                    .collect::<Vec<_>>()
            })
            .await;
            match resolved {
                Ok(more) => ours.extend(more),
                Err(e) => tracing::error!(error = %chain(&e), "resolving container mounts failed"),
            }
        }
        ours
    }

    /// Whether a container with these mounts is this engine's.
    pub(crate) async fn owns(&self, mounts: &[MountPoint]) -> bool {
        if let Some(known) = is_ours_lexically(mounts, &self.roots) {
            return known;
        }
        let (mounts, roots) = (mounts.to_vec(), self.roots.clone());
        tokio::task::spawn_blocking(move || is_ours(&mounts, &roots))
            .await
            .unwrap_or(false)
    }

    /// Whether the container's runner mount is a whole task directory (what the upstream shim
    /// of the version without state files mounted), however the home is spelled.
    pub(crate) async fn mounts_whole_task_dir(&self, mounts: &[MountPoint]) -> Result<bool> {
        let Some(src) = runner_mount(mounts).map(PathBuf::from) else {
            return Ok(false);
        };
        let located = match self.roots.locate_lexically(&src) {
            Some(rel) => Some(rel),
            None => {
                let roots = self.roots.clone();
                tokio::task::spawn_blocking(move || roots.locate(&src)).await?
            }
        };
        Ok(located.is_some_and(|rel| rel.components().count() == 1))
    }
}
