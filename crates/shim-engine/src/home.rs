//! The task store as everyone but the driver sees it ([`Home`]): paths, the start-up scan, the
//! trash, the owner identity; never a record write. The writes of task records are
//! `crate::driver`'s `Records`, whose store is private to the driver: the store is opened
//! there (`driver::open_store`), and this side gets the rest.
//!
//! The store's IO is blocking: it runs on tokio's blocking pool.

use std::path::Path;
use std::sync::Arc;

use shim_store::{Migration, ScanEntry, Store, StoreError, TaskPaths};
use shim_task::TaskRecord;

use crate::error::Result;

/// Runs `f` on the store off the async workers.
pub(crate) async fn blocking<T, F>(store: &Arc<Store>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&Store) -> std::result::Result<T, StoreError> + Send + 'static,
{
    let store = store.clone();
    Ok(tokio::task::spawn_blocking(move || f(&store)).await??)
}

/// The store as everyone but the driver sees it: never a record write.
#[derive(Clone)]
pub(crate) struct Home(Arc<Store>);

impl Home {
    /// The store, without its record writes.
    pub(crate) fn new(store: Arc<Store>) -> Self {
        Self(store)
    }

    /// The shim home.
    pub(crate) fn path(&self) -> &Path {
        self.0.home()
    }

    /// `<home>/runners`.
    pub(crate) fn runners_dir(&self) -> &Path {
        self.0.runners_dir()
    }

    /// The paths of a task's directory (nothing is created).
    pub(crate) fn paths(&self, container_name: &str) -> Result<TaskPaths> {
        Ok(self.0.paths(container_name)?)
    }

    /// Migrates a first-release home, sweeps the trash and scans the task directories (what
    /// restore starts from).
    pub(crate) async fn scan(&self) -> Result<(Migration, usize, Vec<ScanEntry>)> {
        blocking(&self.0, |store| {
            let migration = store.migrate_legacy()?;
            let swept = store.sweep_trash();
            Ok((migration, swept, store.scan()?))
        })
        .await
    }

    /// Removes what a submit cut short before its first write left: a directory without a
    /// state file. Whether it removed one.
    pub(crate) async fn remove_skeleton(&self, container_name: String) -> Result<bool> {
        blocking(&self.0, move |store| store.remove_skeleton(&container_name)).await
    }

    /// Marks a task directory as mounted whole by its container, durably: its state file is
    /// never read again ([`Store::mark_mounted_whole`](shim_store::Store::mark_mounted_whole)).
    pub(crate) async fn mark_mounted_whole(&self, container_name: String) -> Result<()> {
        blocking(&self.0, move |store| {
            store.mark_mounted_whole(&container_name)
        })
        .await
    }

    /// Moves a task directory's state file aside
    /// ([`Store::set_aside_state_file`](shim_store::Store::set_aside_state_file)).
    pub(crate) async fn set_aside_state_file(
        &self,
        container_name: String,
    ) -> Result<Option<std::path::PathBuf>> {
        blocking(&self.0, move |store| {
            store.set_aside_state_file(&container_name)
        })
        .await
    }

    /// Deletes a task directory (and its mark).
    pub(crate) async fn delete(&self, container_name: String) -> Result<()> {
        blocking(&self.0, move |store| store.delete(&container_name)).await
    }

    /// Removes the trash directories; how many.
    pub(crate) async fn sweep_trash(&self) -> Result<usize> {
        blocking(&self.0, |store| Ok(store.sweep_trash())).await
    }

    /// The owner identity stored in the home, if any.
    pub(crate) async fn owner_id(&self) -> Result<Option<String>> {
        blocking(&self.0, |store| store.owner_id()).await
    }

    /// Stores the owner identity once; the one stored (a concurrent first store wins).
    pub(crate) async fn create_owner_id(&self, id: String) -> Result<String> {
        blocking(&self.0, move |store| store.create_owner_id(&id)).await
    }

    /// Whether the home has the first release's layout (`tasks/`).
    pub(crate) fn has_legacy_layout(&self) -> bool {
        self.0.has_legacy_layout()
    }

    /// The records of the first release's layout.
    pub(crate) async fn legacy_records(&self) -> Result<Vec<TaskRecord>> {
        blocking(&self.0, |store| Ok(store.legacy_records())).await
    }
}
