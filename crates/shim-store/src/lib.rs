//! shim-store (work in progress).
