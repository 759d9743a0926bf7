//! What the crate reports: the components, their install states and one entry of the list.

use std::fmt;

/// An installable component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ComponentName {
    /// The in-container agent (`dstack-runner`).
    Runner,
    /// This binary (`dstack-shim`).
    Shim,
}

impl ComponentName {
    /// Both components, in the order [`crate::Components::list`] reports them.
    pub const ALL: [Self; 2] = [Self::Runner, Self::Shim];

    /// The binary's name, as the API and the error messages spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Runner => "dstack-runner",
            Self::Shim => "dstack-shim",
        }
    }
}

impl fmt::Display for ComponentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A component's install state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

/// One component's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentInfo {
    /// The component.
    pub name: ComponentName,
    /// Empty unless [`ComponentStatus::Installed`].
    pub version: String,
    /// The install state.
    pub status: ComponentStatus,
}
