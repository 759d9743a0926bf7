//! shim-resources (work in progress).
