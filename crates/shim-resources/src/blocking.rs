//! The one way this crate runs blocking work (file IO, mount(2), umount(2)) from async code:
//! on tokio's blocking pool, never on an async worker.

use crate::error::{ResourcesError, Result};

/// Runs `f` on tokio's blocking pool; a panic or cancellation of the job is [`ResourcesError::Join`]
/// naming `what`.
pub(crate) async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|source| ResourcesError::Join { what, source })?
}
