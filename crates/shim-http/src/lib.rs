//! shim-http (work in progress).
