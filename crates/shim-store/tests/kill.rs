//! A writer process killed (SIGKILL) at random moments: the state file always holds one whole
//! record, and the next scan removes the interrupted temp files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // test helpers

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shim_store::{ScanEntry, Store};
use shim_task::TaskRecord;

const ROUNDS: u64 = 24;
const HOME_VAR: &str = "SHIM_STORE_KILL_CHILD_HOME";

/// Records told apart by their message, each tied to its `updated_at_ms`.
fn variant(n: u64) -> TaskRecord {
    let mut r = common::record("victim");
    r.termination_message = char::from(b'a' + (n % 26) as u8).to_string().repeat(4096);
    r.updated_at_ms = n;
    r
}

/// Not a test by itself: the child process of `killed_writer_leaves_a_whole_record`, which
/// runs it with `SHIM_STORE_KILL_CHILD_HOME` set. Without it, it returns at once.
#[test]
fn child_writer() {
    let Some(home) = std::env::var_os(HOME_VAR) else {
        return;
    };
    let store = Store::open(&home).unwrap();
    let mut n = 1;
    loop {
        store.write(&variant(n)).unwrap();
        if n == 1 {
            fs_err::write(std::path::Path::new(&home).join("started"), b"").unwrap();
        }
        n += 1;
    }
}

#[test]
fn killed_writer_leaves_a_whole_record() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path()).unwrap();
    let first = variant(0);
    store.create_task_dir(&first.container_name).unwrap();
    store.write(&first).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut interrupted = 0;
    for round in 0..ROUNDS {
        let _ = fs_err::remove_file(home.path().join("started"));
        let mut child = Command::new(&exe)
            .args(["--exact", "child_writer", "--nocapture"])
            .env(HOME_VAR, home.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !home.path().join("started").exists() {
            assert!(Instant::now() < deadline, "the child never started writing");
            assert!(child.try_wait().unwrap().is_none(), "the child died");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Some pseudo-random moment within a few writes.
        std::thread::sleep(Duration::from_micros(round * 1_237 % 7_000));
        child.kill().unwrap();
        child.wait().unwrap();

        let dir = store.paths(&first.container_name).unwrap().dir;
        if common::names(&dir)
            .iter()
            .any(|n| n.starts_with(".task.json.tmp-"))
        {
            interrupted += 1;
        }
        let entries = Store::open(home.path()).unwrap().scan().unwrap();
        let [ScanEntry::Record { record: r, .. }] = &entries[..] else {
            panic!("round {round}: {entries:?}");
        };
        assert_eq!(
            *r,
            variant(r.updated_at_ms),
            "round {round}: a whole record"
        );
        assert!(r.updated_at_ms >= 1, "round {round}: the child wrote");
        let names = common::names(&dir);
        assert_eq!(
            names,
            ["runner", "task.json"],
            "round {round}: temp files removed"
        );
    }
    eprintln!("{interrupted} of {ROUNDS} kills interrupted a write");
    // Writes take most of the child's time: some kills must have landed mid-write, or this
    // test proved nothing.
    assert!(interrupted >= 1);
}
