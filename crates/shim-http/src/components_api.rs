//! The component installer behind the API (feature `components`): [`ComponentsApi`]
//! implemented over `shim_components::Components` (whose types are the wire types), its errors
//! mapped to API error kinds (the status codes themselves are chosen in
//! [`ErrorKind::status`](crate::ErrorKind::status)).

use crate::{ApiError, ComponentsApi};
use async_trait::async_trait;
use shim_components::{ComponentInfo, ComponentName, Components, ComponentsError};
use shim_util::error_chain;

/// The component installer behind the API.
pub struct ComponentsHttp(pub Components);

/// 409 while that component installs, 400 for an empty URL, 500 otherwise; the message is
/// the error with its causes.
fn api_error(e: ComponentsError) -> ApiError {
    let message = error_chain(&e);
    match e {
        ComponentsError::AlreadyInstalling { .. } => ApiError::conflict(message),
        ComponentsError::BadUrl { .. } => ApiError::bad_request(message),
        other => ApiError::internal(message).with_source(other),
    }
}

#[async_trait]
impl ComponentsApi for ComponentsHttp {
    async fn list(&self) -> Vec<ComponentInfo> {
        self.0.list().await
    }

    async fn install(&self, name: ComponentName, url: String) -> Result<(), ApiError> {
        self.0.start_install(name, &url).map_err(api_error)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: panics are failures

    use std::os::unix::fs::PermissionsExt;

    use crate::ErrorKind;
    use shim_components::ComponentsConfig;

    use super::*;

    /// The wire list as the server reads it, from real files.
    #[tokio::test]
    async fn lists_in_the_wire_shape() {
        let dir = tempfile::tempdir().unwrap();
        let shim = dir.path().join("dstack-shim");
        fs_err::write(&shim, "#!/bin/sh\necho 'dstack-shim version 0.22.1'\n").unwrap();
        fs_err::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
        let api = ComponentsHttp(Components::new(ComponentsConfig::new(
            dir.path().join("dstack-runner"),
            &shim,
        )));
        assert_eq!(
            serde_json::to_value(api.list().await).unwrap(),
            serde_json::json!([
                {"name": "dstack-runner", "version": "", "status": "not-installed"},
                {"name": "dstack-shim", "version": "0.22.1", "status": "installed"},
            ])
        );
    }

    #[tokio::test]
    async fn install_errors_map_to_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let api = ComponentsHttp(Components::new(ComponentsConfig::new(
            dir.path().join("dstack-runner"),
            dir.path().join("dstack-shim"),
        )));
        // Another scheme is accepted and fails in the background, as upstream's download
        // does (runner/internal/shim/api/handlers.go, ComponentInstallHandler).
        api.install(ComponentName::Runner, "ftp://x/y".into())
            .await
            .unwrap();
        let e = api
            .install(ComponentName::Shim, String::new())
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadRequest);

        let name = ComponentName::Runner;
        let e = api_error(ComponentsError::AlreadyInstalling { name });
        assert_eq!(
            (e.kind, e.message.as_str()),
            (ErrorKind::Conflict, "dstack-runner is already installing")
        );
        let e = api_error(ComponentsError::Cancelled { name });
        assert_eq!(e.kind, ErrorKind::Internal);
        assert!(e.cause.is_some(), "the cause is kept for the log");
    }
}
