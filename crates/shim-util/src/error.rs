//! An error reported with its causes.
//!
//! The convention every error type of the workspace follows: an error's `Display` describes
//! its own level only (what was being done, on what) and never repeats its source's text; the
//! cause is the `source()`. A reporter that walks the sources, like [`error_chain`] (or
//! anyhow's `{:#}`), then prints each cause once. `#[error(transparent)]` is the one way a
//! level shows its source's text: it *is* that level (its `source()` is the source's own).

use std::error::Error;

/// `e` and its causes on one line, outermost first, separated by `: ` (`cannot write
/// /x/task.json: No space left on device (os error 28)`): what the API answers, a task's
/// termination message and the log show. Each level is printed as its `Display` says, once.
pub fn error_chain(e: &dyn Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot write {path}")]
    struct Write {
        path: &'static str,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("task {0}")]
    struct Task(&'static str, #[source] Write);

    #[test]
    fn prints_every_level_once_outermost_first() {
        let e = Task(
            "t1",
            Write {
                path: "/x/task.json",
                source: std::io::Error::from_raw_os_error(28),
            },
        );
        assert_eq!(
            error_chain(&e),
            "task t1: cannot write /x/task.json: No space left on device (os error 28)"
        );
        assert_eq!(error_chain(&std::io::Error::other("alone")), "alone");
    }
}
