//! The upgrade's decisions, without I/O (SPEC §9, "Upgrade in place"). The binary reads the
//! files, runs `<new> --version`, polls the healthcheck and execs; the facts each step finds
//! go through one function here, which says what follows, so every decision is unit-tested
//! apart from the processes and files it is about:
//!
//! 1. [`installed`]: nothing new at the path → exit, as upstream does;
//! 2. [`read`]: the file read once, unchanged while read (its [`FileKey`] around the digest);
//! 3. [`recorded`]: a binary whose start failed less than [`REFUSE_FOR`] ago is refused again;
//! 4. [`version`]: it must answer `--version`; one of this shim's takes the socket;
//! 5. [`watch`]: the watchdog's verdict at each poll of the new process's healthcheck;
//! 6. [`roll_back`]: after a failed start, the running image goes back unless another binary
//!    was installed meanwhile;
//! 7. [`at_start`]: what a record found at start-up means.
//!
//! [`REFUSE_FOR`]: super::REFUSE_FOR

use std::time::Duration;

use super::RollbackRecord;
use crate::version::FileKey;

/// What marks this shim's version strings (`<dstack release>+rust.<crate version>`): such a
/// binary takes the listening socket through `LISTEN_FDS`; another (upstream's Go shim) binds
/// the port itself.
pub const RUST_MARK: &str = "+rust.";

/// What a pre-flight step says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// On to the next check.
    Next,
    /// Exit, as upstream does on a shutdown: nothing new is installed, or what is there cannot
    /// be trusted to be a finished install. The reason is for the log.
    Exit(String),
    /// Refuse the installed binary: the running image goes back over the path, `record` is
    /// written, `dstack-shim` reports `error` with `why`, and the shim keeps serving.
    Refuse {
        /// What the home keeps about it.
        record: Box<RollbackRecord>,
        /// Why, as `dstack-shim`'s error says.
        why: String,
    },
}

/// What the new process is started as.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Start {
    /// The version it answered.
    pub version: String,
    /// Whether it takes the listening socket (`LISTEN_FDS`).
    pub takes_socket: bool,
}

/// Step 1: `differs` is the file at the path compared with the running image (`Ok(false)`
/// also when there is no file).
pub fn installed(differs: Result<bool, String>) -> Step {
    match differs {
        Ok(true) => Step::Next,
        Ok(false) => Step::Exit("no new binary is installed".to_owned()),
        Err(e) => Step::Exit(format!(
            "cannot tell whether a new binary is installed: {e}"
        )),
    }
}

/// Step 2: the installed file's key before and after its digest was taken. A digest that
/// cannot be taken refuses the file (it cannot be started safely); a file that cannot be
/// stat'ed, or that changed while it was read (an install by hand in progress: the server
/// waits for its own), is no finished install: exit. `Ok`: the file started is the one read.
pub fn read(
    before: Result<FileKey, String>,
    sha256: Result<String, String>,
    after: Result<FileKey, String>,
    running_version: &str,
) -> Result<(FileKey, String), Step> {
    let sha256 = match sha256 {
        Ok(sha) => sha,
        Err(e) => return Err(refuse("", "", &e, running_version)),
    };
    match (before, after) {
        (Ok(before), Ok(after)) if before == after => Ok((before, sha256)),
        (Err(e), _) | (_, Err(e)) => {
            Err(Step::Exit(format!("cannot stat the installed binary: {e}")))
        }
        _ => Err(Step::Exit(
            "the installed binary changed while it was read".to_owned(),
        )),
    }
}

/// Step 3: the record in the home, if any, against the installed binary's digest at `now`
/// (seconds since the epoch). The same binary failing to start less than an hour ago is
/// refused again with that record unchanged, so the refusal ends an hour after the failure,
/// not after the last refusal.
pub fn recorded(record: Option<&RollbackRecord>, sha256: &str, now: u64) -> Step {
    match record {
        Some(r) if r.refuses(sha256, now) => {
            let ago = now.saturating_sub(r.at_unix);
            Step::Refuse {
                record: Box::new(r.clone()),
                why: format!(
                    "the same binary failed to start {ago} s ago ({}); it is not started again \
                     until an hour has passed since",
                    r.reason
                ),
            }
        }
        _ => Step::Next,
    }
}

/// Step 4: what `<new> --version` answered (`Err`: it did not answer `dstack-shim version X`
/// in time). A binary that does not answer is never started.
pub fn version(
    answer: Result<String, String>,
    sha256: &str,
    running_version: &str,
) -> Result<Start, Step> {
    match answer {
        Ok(version) => Ok(Start {
            takes_socket: version.contains(RUST_MARK),
            version,
        }),
        Err(e) => Err(refuse("", sha256, &e, running_version)),
    }
}

fn refuse(version: &str, sha256: &str, why: &str, running_version: &str) -> Step {
    Step::Refuse {
        record: Box::new(RollbackRecord::now(version, sha256, why, running_version)),
        why: why.to_owned(),
    }
}

/// The watchdog's verdict after one poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watch {
    /// The new binary answers with the version it was started for: the upgrade is done.
    Done,
    /// Poll again.
    Wait,
    /// The start failed: roll back (and kill the process when it still runs: `hung`).
    Failed {
        /// Why, for the record and `dstack-shim`'s error.
        why: String,
        /// The process still runs (it did not answer in time).
        hung: bool,
    },
}

/// Step 5: what the healthcheck answered (`Ok(version)`, `Err(what failed)`), whether the
/// watched PID (the watchdog's parent, the process that exec'ed) still runs, and whether
/// `timeout` has passed since the exec.
pub fn watch(
    answer: Result<String, String>,
    expected: &str,
    parent_alive: bool,
    timed_out: bool,
    timeout: Duration,
) -> Watch {
    let last = match answer {
        Ok(v) if v == expected => return Watch::Done,
        Ok(v) => format!("it answers version {v}"),
        Err(e) => e,
    };
    if !parent_alive {
        Watch::Failed {
            why: format!("it exited before it answered its healthcheck (last: {last})"),
            hung: false,
        }
    } else if timed_out {
        Watch::Failed {
            why: format!("it did not answer within {timeout:?} (last: {last})"),
            hung: true,
        }
    } else {
        Watch::Wait
    }
}

/// Step 6: after a failed start, whether the running image goes back over the path, which now
/// holds a file of digest `current`: yes when it is still the binary that failed, or when it
/// cannot be read (the previous binary is known to start); no when another binary was
/// installed meanwhile (the server's next install: it is left for the next shutdown).
pub fn roll_back(current: Result<String, String>, failed_sha256: &str) -> bool {
    match current {
        Ok(now) => now == failed_sha256,
        Err(_) => true,
    }
}

/// What a record found at start-up means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtStart {
    /// An upgrade of this very binary was rolled back: `dstack-shim` reports `error` with
    /// the reason until the next install.
    Report(String),
    /// A record about another binary (a later upgrade succeeded) or one that cannot be read:
    /// remove it.
    Remove,
    /// No record.
    Nothing,
}

/// Step 7: the record in the home at start-up, for the binary of `running_version`.
pub fn at_start(record: Result<Option<RollbackRecord>, String>, running_version: &str) -> AtStart {
    match record {
        Ok(Some(r)) if r.restored_version == running_version => AtStart::Report(r.reason),
        Ok(Some(_)) | Err(_) => AtStart::Remove,
        Ok(None) => AtStart::Nothing,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: panics are failures

    use super::*;

    const RUNNING: &str = "0.22.5+rust.0.1.0";

    fn key(path: &std::path::Path) -> FileKey {
        FileKey::at(path).unwrap()
    }

    fn refused(step: &Step) -> (&str, &str, &str) {
        match step {
            Step::Refuse { record, why } => {
                assert_eq!(record.reason, *why);
                assert_eq!(record.restored_version, RUNNING);
                (
                    record.failed_version.as_str(),
                    record.failed_sha256.as_str(),
                    why.as_str(),
                )
            }
            other => panic!("not a refusal: {other:?}"),
        }
    }

    #[test]
    fn nothing_new_or_unknown_exits_as_upstream() {
        assert_eq!(installed(Ok(true)), Step::Next);
        assert!(matches!(installed(Ok(false)), Step::Exit(_)));
        match installed(Err("permission denied".into())) {
            Step::Exit(why) => assert!(why.contains("permission denied"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// The file started is the file read: a file changed while it was read, or one that
    /// cannot be stat'ed, is no finished install (exit); one that cannot be read is refused.
    #[test]
    fn the_file_must_stay_the_same_while_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        fs_err::write(&a, "one").unwrap();
        fs_err::write(&b, "two").unwrap();
        let (ka, kb) = (key(&a), key(&b));
        assert_ne!(ka, kb);
        assert_eq!(
            read(Ok(ka), Ok("sha".into()), Ok(ka), RUNNING),
            Ok((ka, "sha".to_owned()))
        );
        assert!(matches!(
            read(Ok(ka), Ok("sha".into()), Ok(kb), RUNNING),
            Err(Step::Exit(why)) if why.contains("changed while it was read")
        ));
        assert!(matches!(
            read(Err("gone".into()), Ok("sha".into()), Ok(ka), RUNNING),
            Err(Step::Exit(why)) if why.contains("cannot stat") && why.contains("gone")
        ));
        let step = read(Ok(ka), Err("EIO".into()), Ok(ka), RUNNING).unwrap_err();
        assert_eq!(refused(&step), ("", "", "EIO"));
    }

    /// The hour runs from the failure: a refusal repeats the record as it was.
    #[test]
    fn a_binary_that_failed_within_the_hour_is_refused_with_its_record() {
        let failed = RollbackRecord {
            failed_version: "0.22.6+rust.0.1.1".into(),
            failed_sha256: "bad".into(),
            reason: "it exited".into(),
            restored_version: RUNNING.into(),
            at_unix: 1_000,
        };
        assert_eq!(recorded(None, "bad", 1_000), Step::Next);
        assert_eq!(recorded(Some(&failed), "good", 1_001), Step::Next);
        match recorded(Some(&failed), "bad", 1_060) {
            Step::Refuse { record, why } => {
                assert_eq!(*record, failed, "the record is kept unchanged");
                assert!(
                    why.contains("failed to start 60 s ago (it exited)"),
                    "{why}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            recorded(Some(&failed), "bad", 1_000 + 3_599),
            Step::Refuse { .. }
        ));
        assert_eq!(recorded(Some(&failed), "bad", 1_000 + 3_600), Step::Next);
    }

    #[test]
    fn a_binary_must_answer_its_version_and_only_ours_takes_the_socket() {
        assert_eq!(
            version(Ok("0.22.6+rust.0.1.1".into()), "sha", RUNNING),
            Ok(Start {
                version: "0.22.6+rust.0.1.1".into(),
                takes_socket: true
            })
        );
        assert_eq!(
            version(Ok("0.22.6".into()), "sha", RUNNING),
            Ok(Start {
                version: "0.22.6".into(),
                takes_socket: false
            }),
            "upstream's Go shim binds the port itself"
        );
        let step = version(Err("no answer in 5 s".into()), "sha", RUNNING).unwrap_err();
        assert_eq!(refused(&step), ("", "sha", "no answer in 5 s"));
    }

    #[test]
    fn the_watchdog_waits_for_the_version_it_started() {
        let t = Duration::from_secs(60);
        let new = "0.22.6+rust.0.1.1";
        assert_eq!(watch(Ok(new.into()), new, true, false, t), Watch::Done);
        // Answering in time wins over a timeout seen in the same poll.
        assert_eq!(watch(Ok(new.into()), new, true, true, t), Watch::Done);
        assert_eq!(
            watch(Err("connection refused".into()), new, true, false, t),
            Watch::Wait
        );
        // The old version still answering (the old process, before the exec): wait.
        assert_eq!(watch(Ok(RUNNING.into()), new, true, false, t), Watch::Wait);
        assert_eq!(
            watch(Err("connection refused".into()), new, false, false, t),
            Watch::Failed {
                why: "it exited before it answered its healthcheck (last: connection refused)"
                    .into(),
                hung: false
            }
        );
        assert_eq!(
            watch(Ok(RUNNING.into()), new, true, true, t),
            Watch::Failed {
                why: format!("it did not answer within 60s (last: it answers version {RUNNING})"),
                hung: true
            }
        );
    }

    #[test]
    fn a_failed_start_is_rolled_back_unless_another_binary_came() {
        assert!(roll_back(Ok("bad".into()), "bad"));
        assert!(!roll_back(Ok("newer".into()), "bad"));
        assert!(roll_back(Err("EIO".into()), "bad"));
    }

    #[test]
    fn a_record_at_start_is_reported_only_by_the_binary_it_restored() {
        let record = RollbackRecord::now("0.22.6", "bad", "it hung", RUNNING);
        assert_eq!(
            at_start(Ok(Some(record.clone())), RUNNING),
            AtStart::Report("it hung".into())
        );
        assert_eq!(
            at_start(Ok(Some(record)), "0.22.7+rust.0.1.2"),
            AtStart::Remove
        );
        assert_eq!(at_start(Err("bad json".into()), RUNNING), AtStart::Remove);
        assert_eq!(at_start(Ok(None), RUNNING), AtStart::Nothing);
    }
}
