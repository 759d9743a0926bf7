//! The `dstack-shim` binary.

fn main() {}
