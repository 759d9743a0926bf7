//! The effects' part of a task's slot ([`Pulling`]): what its image pull needs that the
//! record does not hold. Only the effects use it; the driver makes it at submit.

use shim_runtime::RegistryAuth;
use tokio_util::sync::CancellationToken;

/// A task's pull: its registry credentials (memory only: never written) and its cancellation.
#[derive(Debug, Default)]
pub(crate) struct Pulling {
    auth: Option<RegistryAuth>,
    cancel: CancellationToken,
}

impl Pulling {
    /// The pull of a task submitted with `auth`.
    pub(crate) fn new(auth: Option<RegistryAuth>) -> Self {
        Self {
            auth,
            cancel: CancellationToken::new(),
        }
    }

    /// The credentials.
    pub(crate) fn auth(&self) -> Option<RegistryAuth> {
        self.auth.clone()
    }

    /// Cancels the pull in flight, and any later one.
    pub(crate) fn cancel(&self) {
        self.cancel.cancel();
    }

    /// A token cancelled with the task's pull (a pull may also cancel it on its own).
    pub(crate) fn token(&self) -> CancellationToken {
        self.cancel.child_token()
    }
}
