//! A host user made for one test (`useradd`, no login shell, home in the test's directory),
//! deleted when dropped: the shim finds it in the passwd database like any host user and
//! writes its `authorized_keys`. Needs root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::wait::wait_for;

/// How long `useradd` may keep failing because another process holds the passwd lock.
const LOCK_BOUND: Duration = Duration::from_secs(60);

/// A system user of one test, deleted (`userdel`) when dropped.
#[derive(Debug)]
pub struct HostUser {
    name: String,
    home: PathBuf,
}

/// Runs `program args` (no stdin) to its end; panics if it cannot run.
#[allow(
    clippy::panic,
    reason = "a test helper: a missing useradd or userdel fails the test"
)]
fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {program} (the tests that need it run as root): {e}")
        })
}

impl HostUser {
    /// Makes a user whose name is unique to this process (`shimt<pid>n<k>`) with its home
    /// `<dir>/user-<name>` (created, empty, owned by root until [`HostUser::add_line`]).
    /// `useradd` is retried (bounded) while another process holds the passwd lock, after a
    /// `userdel` of a leftover of the same name. Panics if the user cannot be made.
    #[allow(
        clippy::panic,
        reason = "a test helper: a user that cannot be made fails the test"
    )]
    pub fn create(dir: &Path) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "shimt{}n{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let home = dir.join(format!("user-{name}"));
        fs_err::create_dir_all(&home).unwrap_or_else(|e| panic!("{e}"));
        let home_str = home.display().to_string();
        wait_for(&format!("useradd {name}"), LOCK_BOUND, || {
            let _ = run("userdel", &[&name]);
            let out = run(
                "useradd",
                &["-M", "-d", &home_str, "-s", "/usr/sbin/nologin", &name],
            );
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        });
        Self { name, home }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its home directory.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// The path of its `~/.ssh/authorized_keys`.
    pub fn authorized_keys(&self) -> PathBuf {
        self.home.join(".ssh").join("authorized_keys")
    }

    /// The lines of its `authorized_keys` (none if there is no file); panics if the file
    /// cannot be read.
    #[allow(
        clippy::panic,
        reason = "a test helper: an unreadable file fails the test"
    )]
    pub fn lines(&self) -> Vec<String> {
        match fs_err::read_to_string(self.authorized_keys()) {
            Ok(text) => text.lines().map(str::to_owned).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("{e}"),
        }
    }

    /// Appends `line` to its `authorized_keys` as the user would ([`append_key_line`]), and
    /// gives its home to it (`chown -R`).
    pub fn add_line(&self, line: &str) {
        append_key_line(&self.authorized_keys(), line);
        let owner = format!("{0}:{0}", self.name);
        let out = run("chown", &["-R", &owner, &self.home.display().to_string()]);
        assert!(
            out.status.success(),
            "chown -R {owner} {}: {}",
            self.home.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Appends `line` to the `authorized_keys` file `path` as its user would: no marker, on a line
/// of its own, the file and its directory created if missing.
#[allow(clippy::panic, reason = "a test helper: a failed write fails the test")]
pub fn append_key_line(path: &Path, line: &str) {
    if let Some(ssh) = path.parent() {
        fs_err::create_dir_all(ssh).unwrap_or_else(|e| panic!("{e}"));
    }
    let mut text = match fs_err::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => panic!("{e}"),
    };
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
    fs_err::write(path, text).unwrap_or_else(|e| panic!("{e}"));
}

impl Drop for HostUser {
    #[allow(
        clippy::print_stderr,
        reason = "tells the person running the tests what could not be cleaned up"
    )]
    fn drop(&mut self) {
        // userdel also waits for the passwd lock; 6: no such user.
        for _ in 0..50 {
            let out = Command::new("userdel")
                .arg(&self.name)
                .stdin(Stdio::null())
                .output();
            if out.is_ok_and(|o| o.status.success() || o.status.code() == Some(6)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("cleanup: cannot delete the test user {}", self.name);
    }
}
