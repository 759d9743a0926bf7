//! What the runtime's benchmark programs share: their command line.

use std::path::PathBuf;

/// `[--quick] [--json PATH]`, and whether `cargo bench` ran the program (`--bench`).
pub struct Args {
    /// Fewer rounds (CI's smoke run).
    pub quick: bool,
    /// Run by `cargo bench`; without it the program only says what it needs.
    pub benching: bool,
    /// Where to write the figures as JSON.
    pub json: Option<PathBuf>,
}

impl Args {
    /// This process's arguments; unknown ones (cargo's own) are ignored.
    pub fn parse() -> Self {
        let mut parsed = Self {
            quick: false,
            benching: false,
            json: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => parsed.quick = true,
                "--bench" => parsed.benching = true,
                "--json" => parsed.json = Some(PathBuf::from(args.next().expect("--json PATH"))),
                _ => {}
            }
        }
        parsed
    }
}
