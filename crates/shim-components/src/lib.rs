//! Installs and reports the shim's components (work in progress).
