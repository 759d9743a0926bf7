//! Developer tasks.

fn main() {}
