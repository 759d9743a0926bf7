//! shim-engine (work in progress).
