//! An error reported with its causes.
//!
//! The convention every error type of the workspace follows: an error's `Display` describes
//! its own level only (what was being done, on what) and never repeats its source's text; the
//! cause is the `source()`. A reporter that walks the sources, like [`error_chain`] (or
//! anyhow's `{:#}`), then prints each cause once. `#[error(transparent)]` is the one way a
//! level shows its source's text: it *is* that level (its `source()` is the source's own).

use std::error::Error;

/// A boxed foreign error, kept as the `source()` of an error of this workspace's crates.
pub type BoxError = Box<dyn Error + Send + Sync + 'static>;

/// `e` and its causes on one line, outermost first, separated by `: ` (`cannot write
/// /x/task.json: No space left on device (os error 28)`): what the API answers, a task's
/// termination message and the log show. Each level is printed as its `Display` says, once.
///
/// Errors of other crates (std's, bollard's, hyper's) do not all follow the convention: a
/// cause whose text the line already ends with is not appended again.
pub fn error_chain(e: &dyn Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
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

    /// A foreign error that repeats its cause in its own text (not this workspace's
    /// convention) is not printed with the cause twice.
    #[derive(Debug, thiserror::Error)]
    #[error("request failed: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[test]
    fn a_cause_already_in_the_text_is_not_repeated() {
        let e = Repeats(std::io::Error::other("connection reset"));
        assert_eq!(error_chain(&e), "request failed: connection reset");
    }
}
