//! A writer process killed (SIGKILL) at random moments: the target always holds one whole
//! version, and the temp files the kills interrupted are recognised and removed by the next
//! process. (Ported from shim-store's tests/kill.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // test helpers

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shim_fs::{Dir, WriteOptions, is_temp_of};

const ROUNDS: u64 = 24;
const DIR_VAR: &str = "SHIM_FS_KILL_CHILD_DIR";

/// Version `n`: a header naming it, then 64 KiB of one letter.
fn variant(n: u64) -> Vec<u8> {
    let mut v = format!("version {n}\n").into_bytes();
    v.extend(std::iter::repeat_n(b'a' + (n % 26) as u8, 64 * 1024));
    v
}

fn version_of(content: &[u8]) -> u64 {
    let header = content.split(|&b| b == b'\n').next().unwrap();
    let header = std::str::from_utf8(header).unwrap();
    header.strip_prefix("version ").unwrap().parse().unwrap()
}

/// Not a test by itself: the child process of `killed_writer_leaves_a_whole_version`, which
/// runs it with `SHIM_FS_KILL_CHILD_DIR` set. Without it, it returns at once.
#[test]
fn child_writer() {
    let Some(dir) = std::env::var_os(DIR_VAR) else {
        return;
    };
    let d = Dir::open(Path::new(&dir).join("data")).unwrap();
    let opts = WriteOptions::new(0o600);
    let mut n = 1;
    loop {
        d.write_atomic("state", &variant(n), &opts).unwrap();
        if n == 1 {
            fs_err::write(Path::new(&dir).join("started"), b"").unwrap();
        }
        n += 1;
    }
}

#[test]
fn killed_writer_leaves_a_whole_version() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    fs_err::create_dir(&data).unwrap();
    let d = Dir::open(&data).unwrap();
    d.write_atomic("state", &variant(0), &WriteOptions::new(0o600))
        .unwrap();
    let exe = std::env::current_exe().unwrap();
    let started = tmp.path().join("started");
    let mut interrupted = 0;
    for round in 0..ROUNDS {
        let _ = fs_err::remove_file(&started);
        let mut child = Command::new(&exe)
            .args(["--exact", "child_writer", "--nocapture"])
            .env(DIR_VAR, tmp.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !started.exists() {
            assert!(Instant::now() < deadline, "the child never started writing");
            assert!(child.try_wait().unwrap().is_none(), "the child died");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Some pseudo-random moment within a few writes.
        std::thread::sleep(Duration::from_micros(round * 1_237 % 7_000));
        child.kill().unwrap();
        child.wait().unwrap();

        let names = d.names().unwrap();
        let temps = names.iter().filter(|n| is_temp_of("state", n)).count();
        interrupted += usize::from(temps > 0);
        let (content, info) = d.read_file("state", 1 << 20).unwrap().unwrap();
        let n = version_of(&content);
        assert!(n >= 1, "round {round}: the child wrote");
        assert_eq!(content, variant(n), "round {round}: a whole version");
        assert_eq!(info.mode, 0o600, "round {round}");
        // This process is not the one that left them: they are stale, and removed.
        let removed = d.remove_stale_temps("state").unwrap();
        assert_eq!(removed, temps, "round {round}");
        let mut names: Vec<_> = d.names().unwrap();
        names.sort();
        assert_eq!(names, ["state"], "round {round}: temp files removed");
    }
    eprintln!("{interrupted} of {ROUNDS} kills interrupted a write");
    // Writes take most of the child's time: some kills must have landed mid-write, or this
    // test proved nothing.
    assert!(interrupted >= 1);
}
