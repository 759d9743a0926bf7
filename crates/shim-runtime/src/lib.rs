//! shim-runtime (work in progress).
