//! What the crate reports: the components, their install states and one entry of the list,
//! each serialised as dstack's shim API spells it (`GET /api/components`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// An installable component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ComponentName {
    /// The in-container agent (`dstack-runner`).
    #[serde(rename = "dstack-runner")]
    Runner,
    /// This binary (`dstack-shim`).
    #[serde(rename = "dstack-shim")]
    Shim,
}

impl ComponentName {
    /// Both components, in the order `Components::list` reports them.
    pub const ALL: [Self; 2] = [Self::Runner, Self::Shim];

    /// The binary's name, as the API and the error messages spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Runner => "dstack-runner",
            Self::Shim => "dstack-shim",
        }
    }

    /// The component of a wire name (`dstack-runner`, `dstack-shim`).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ComponentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A component's install state (`not-installed`, `installed`, `installing`, `error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComponentStatus {
    /// No binary at the configured path.
    NotInstalled,
    /// A binary that reports its version.
    Installed,
    /// A download is in progress.
    Installing,
    /// The last install failed, or the binary does not report a version.
    Error,
}

/// One component's state: one entry of `GET /api/components`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentInfo {
    /// The component.
    pub name: ComponentName,
    /// Empty unless [`ComponentStatus::Installed`].
    pub version: String,
    /// The install state.
    pub status: ComponentStatus,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: panics are failures

    use super::*;

    /// The entry as upstream's shim writes it (`ComponentInfo`, `ComponentStatus` in
    /// `runner/docs/shim.openapi.yaml`: `name`, `version`, `status`).
    #[test]
    fn entries_have_the_wire_shape() {
        for name in ComponentName::ALL {
            assert_eq!(ComponentName::parse(name.as_str()), Some(name));
            assert_eq!(
                serde_json::to_value(name).unwrap(),
                serde_json::json!(name.as_str())
            );
        }
        assert_eq!(ComponentName::parse("dstack-server"), None);
        let info = ComponentInfo {
            name: ComponentName::Shim,
            version: String::new(),
            status: ComponentStatus::NotInstalled,
        };
        let wire =
            serde_json::json!({"name": "dstack-shim", "version": "", "status": "not-installed"});
        assert_eq!(serde_json::to_value(&info).unwrap(), wire);
        assert_eq!(serde_json::from_value::<ComponentInfo>(wire).unwrap(), info);
    }
}
