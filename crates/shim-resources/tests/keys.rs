//! authorized_keys against real files in temporary homes (no root needed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use shim_resources::keys::{MARKER, Rewrite, marked_line, parse_marked_line, render};
use shim_resources::{
    AuthorizedKeys, AuthorizedKeysManager, ResourcesError, StaticUserDb, UserDb as _,
};
use shim_task::{PublicKey, TaskId};
use shim_util::testing::require_root;

// Generated with ssh-keygen; fingerprints as `ssh-keygen -l` printed them.
const K1: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILJGWz0/8QjYK+L+mj9V7g/pcOzi/5qYPRvJ0QrLvroM user1@host";
const K1_FP: &str = "SHA256:2DTPWGjxUaZLgAK1dXrpRy0NzNFdEC88p2W35qCmeXY";
const K2: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIjY0BqsQsHfRsbOue0mJhmhj/RTNPTIVoiDvsMluylj user2@host";
const K3: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMYbIVPdSaeAJtsHT7WxEAWvFN5k2J7MntJ7UTNKQn1o user3@host";
const K4: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQDDWxDV3/eP8Na9Nm/AjQn/R3lzb+OYQEFoOkfacNOt49QuT/g2+DQjTt+z5Bopbdwzx3Pr+MjYvOSBzo01N/dVlfOfWxFCiBU55EqKtYRu3GSe3Mv3VgrxpJxWaQisPTZh8y4ovI20NmY6h3mUBCU5lUNUHBcn+vAW0P0tLQKYjw== rsa@host";

fn key(s: &str) -> PublicKey {
    PublicKey::parse(s).unwrap()
}

fn keys(lines: &[&str]) -> Vec<PublicKey> {
    lines.iter().copied().map(key).collect()
}

fn task(s: &str) -> TaskId {
    TaskId::new(s).unwrap()
}

/// The key's fingerprint, as [`Home::marked`] lists it.
fn fp(line: &str) -> String {
    key(line).fingerprint().to_owned()
}

/// The line the manager writes for the key (with its marker), without a newline.
fn mark(line: &str) -> String {
    marked_line(&key(line))
}

// The manager's calls as the tests make them: task ids and keys as strings; `add` and `remove`
// must succeed.

async fn add(m: &AuthorizedKeysManager, t: &str, user: &str, lines: &[&str]) {
    m.add(&task(t), user, &keys(lines)).await.unwrap();
}

/// An `add` that must fail.
async fn add_err(m: &AuthorizedKeysManager, t: &str, user: &str, lines: &[&str]) -> ResourcesError {
    m.add(&task(t), user, &keys(lines)).await.unwrap_err()
}

async fn remove(m: &AuthorizedKeysManager, t: &str, user: &str, lines: &[&str]) {
    m.remove(&task(t), user, &keys(lines)).await.unwrap();
}

fn restore(m: &AuthorizedKeysManager, t: &str, user: &str, lines: &[&str]) {
    m.restore(&task(t), user, &keys(lines));
}

/// A rewrite that keeps `wanted`, releases `released` (and, as upstream would, the unmarked
/// lines of `released_unmarked`), and prunes marked lines of unknown origin if `prune_unknown`.
fn rewrite<'a>(
    wanted: &'a [PublicKey],
    released: &'a [PublicKey],
    prune_unknown: bool,
    released_unmarked: &'a [PublicKey],
) -> Rewrite<'a> {
    Rewrite {
        wanted,
        released,
        prune_unknown,
        released_unmarked,
    }
}

/// `render` of `old` as text.
fn rendered(old: &str, rw: &Rewrite<'_>) -> String {
    String::from_utf8(render(old.as_bytes(), rw)).unwrap()
}

/// Two users in a temporary directory: alice, whose home exists, and bob, whose home does not
/// (a test makes it where it needs it).
struct Home {
    _tmp: tempfile::TempDir,
    home: PathBuf,
    manager: AuthorizedKeysManager,
}

impl Home {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("alice");
        fs_err::create_dir(&home).unwrap();
        Self {
            manager: Self::manager_for(&home),
            home,
            _tmp: tmp,
        }
    }

    fn manager_for(home: &Path) -> AuthorizedKeysManager {
        let db = StaticUserDb::new()
            .with_user("alice", home)
            .with_user("bob", home.parent().unwrap().join("bob"));
        AuthorizedKeysManager::new(Arc::new(db))
    }

    /// A fresh manager over the same homes (a restart: nothing in memory).
    fn restarted(&self) -> AuthorizedKeysManager {
        Self::manager_for(&self.home)
    }

    /// A path beside alice's home (bob's home, a file to protect).
    fn beside(&self, name: &str) -> PathBuf {
        self.home.parent().unwrap().join(name)
    }

    fn file_of(&self, user: &str) -> PathBuf {
        self.beside(user).join(".ssh/authorized_keys")
    }

    fn read_of(&self, user: &str) -> String {
        fs_err::read_to_string(self.file_of(user)).unwrap()
    }

    fn write_of(&self, user: &str, content: &str) {
        fs_err::create_dir_all(self.beside(user).join(".ssh")).unwrap();
        fs_err::write(self.file_of(user), content).unwrap();
    }

    fn file(&self) -> PathBuf {
        self.file_of("alice")
    }

    fn read(&self) -> String {
        self.read_of("alice")
    }

    fn write(&self, content: &str) {
        self.write_of("alice", content);
    }

    #[track_caller]
    fn assert_foreign_line_kept(&self) {
        let kept = self.read().starts_with(&format!("{K4}\n"));
        assert!(kept, "foreign line kept");
    }

    /// Fingerprints of the marked lines, in file order.
    fn marked(&self) -> Vec<String> {
        self.read()
            .lines()
            .filter_map(parse_marked_line)
            .map(|k| k.fingerprint().to_owned())
            .collect()
    }
}

fn mode(p: &Path) -> u32 {
    fs_err::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[tokio::test]
async fn creates_ssh_dir_and_file_with_modes_and_owner() {
    let h = Home::new();
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    add(&h.manager, "t1", "alice", &[K1, K4]).await;
    nix::sys::stat::umask(old);
    assert_eq!(mode(&h.home.join(".ssh")), 0o700);
    assert_eq!(mode(&h.file()), 0o600);
    let meta = fs_err::metadata(h.file()).unwrap();
    assert_eq!(meta.uid(), nix::unistd::getuid().as_raw());
    let want = format!("{} {MARKER}\n{} {MARKER}\n", key(K1).line(), key(K4).line());
    assert_eq!(h.read(), want);
    // No backup of a file that did not exist; no temp file left.
    assert!(!h.home.join(".ssh/authorized_keys.bak").exists());
    let names: Vec<_> = fs_err::read_dir(h.home.join(".ssh"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["authorized_keys"]);
}

#[tokio::test]
async fn written_file_is_read_by_ssh_keygen() {
    let h = Home::new();
    add(&h.manager, "t1", "alice", &[K1, K4]).await;
    let keygen = std::process::Command::new("ssh-keygen")
        .args(["-l", "-f"])
        .arg(h.file())
        .output();
    let out = match keygen {
        Ok(out) => out,
        Err(e) => {
            // Where the test command says the dev-env is there (SHIM_TEST_DOCKER=1: it
            // installs openssh), it must not skip.
            let dev_env = std::env::var("SHIM_TEST_DOCKER").is_ok_and(|v| v == "1");
            assert!(
                !dev_env,
                "SHIM_TEST_DOCKER=1, but ssh-keygen cannot run: {e}"
            );
            return eprintln!("skipped the ssh-keygen cross-check: cannot run ssh-keygen: {e}");
        }
    };
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{text} {err}");
    assert!(text.contains(K1_FP) && text.contains(MARKER), "{text}");
    assert_eq!(text.lines().count(), 2, "{text}");
}

#[tokio::test]
async fn preserves_foreign_lines_mode_and_keeps_backup() {
    let h = Home::new();
    let original = format!(
        "# my comment\n{K2}\nthis is garbage \t with tabs\n\ncommand=\"x\" {K3}\n\u{e9}t\u{e9} caf\u{e9}\n"
    );
    h.write(&original);
    fs_err::set_permissions(h.file(), std::fs::Permissions::from_mode(0o640)).unwrap();
    add(&h.manager, "t1", "alice", &[K1]).await;
    assert_eq!(h.read(), format!("{original}{} {MARKER}\n", key(K1).line()));
    assert_eq!(mode(&h.file()), 0o640, "mode kept");
    let backup = fs_err::read_to_string(h.home.join(".ssh/authorized_keys.bak")).unwrap();
    assert_eq!(backup, original);
    remove(&h.manager, "t1", "alice", &[]).await;
    assert_eq!(h.read(), original, "back to the original byte for byte");
    assert_eq!(mode(&h.file()), 0o640);
}

#[tokio::test]
async fn invalid_utf8_and_missing_final_newline_survive() {
    let h = Home::new();
    fs_err::create_dir_all(h.home.join(".ssh")).unwrap();
    let mut original = b"\xff\xfe binary junk\n".to_vec();
    original.extend_from_slice(K2.as_bytes()); // no final newline
    fs_err::write(h.file(), &original).unwrap();
    add(&h.manager, "t1", "alice", &[K1]).await;
    let now = fs_err::read(h.file()).unwrap();
    assert!(now.starts_with(&original));
    remove(&h.manager, "t1", "alice", &[]).await;
    let mut expected = original.clone();
    expected.push(b'\n');
    assert_eq!(fs_err::read(h.file()).unwrap(), expected);
}

#[tokio::test]
async fn shared_key_survives_release_of_first_task() {
    let h = Home::new();
    add(&h.manager, "a", "alice", &[K1, K2]).await;
    add(&h.manager, "b", "alice", &[K2, K3]).await;
    let all = vec![fp(K1), fp(K2), fp(K3)];
    assert_eq!(h.marked(), all, "no duplicate line for K2");
    remove(&h.manager, "a", "alice", &[]).await;
    assert_eq!(h.marked(), vec![fp(K2), fp(K3)]);
    remove(&h.manager, "b", "alice", &[]).await;
    assert!(h.marked().is_empty());
    // Idempotent.
    remove(&h.manager, "b", "alice", &[]).await;
    assert!(h.marked().is_empty());
}

#[tokio::test]
async fn foreign_line_with_same_key_is_never_removed() {
    let h = Home::new();
    // The user's own line holds K1 in another formatting (other comment, extra spaces).
    let own = K1.replace(' ', "   ").replace("user1@host", "laptop");
    h.write(&format!("{own}\n"));
    add(&h.manager, "a", "alice", &[K1]).await;
    assert_eq!(h.marked(), vec![K1_FP.to_owned()]);
    remove(&h.manager, "a", "alice", &[]).await;
    assert_eq!(h.read(), format!("{own}\n"));
}

#[tokio::test]
async fn marked_line_in_other_formatting_is_recognized() {
    let h = Home::new();
    // A marked line written with different spacing and comment: still ours, same key.
    let k1 = K1.replace("user1@host", "").replace(' ', "  ");
    h.write(&format!("{k1} {MARKER}\n"));
    restore(&h.manager, "a", "alice", &[K1]);
    add(&h.manager, "b", "alice", &[K1]).await;
    assert_eq!(h.marked(), vec![K1_FP.to_owned()], "not duplicated");
    remove(&h.manager, "a", "alice", &[]).await;
    assert_eq!(h.marked(), vec![K1_FP.to_owned()], "b still needs it");
    remove(&h.manager, "b", "alice", &[]).await;
    assert!(h.marked().is_empty());
}

#[tokio::test]
async fn restart_restore_then_remove_keeps_live_keys() {
    let h = Home::new();
    h.write(&format!("{K4}\n"));
    add(&h.manager, "a", "alice", &[K1, K2]).await;
    add(&h.manager, "b", "alice", &[K2]).await;
    add(&h.manager, "c", "alice", &[K3]).await;

    // Restart: a fresh manager, empty memory. b and c are live; a finished while down.
    let after = h.restarted();
    restore(&after, "b", "alice", &[K2]);
    restore(&after, "c", "alice", &[K3]);
    // Restore alone touches nothing.
    assert_eq!(h.marked(), vec![fp(K1), fp(K2), fp(K3)]);
    remove(&after, "a", "alice", &[K1, K2]).await;
    assert_eq!(h.marked(), vec![fp(K2), fp(K3)]);
    h.assert_foreign_line_kept();
    let live: Vec<_> = after.live_tasks().into_iter().map(|(t, _)| t).collect();
    assert_eq!(live, vec![task("b"), task("c")]);
}

#[tokio::test]
async fn leftover_marked_line_without_a_task_is_pruned_on_next_removal() {
    let h = Home::new();
    // A crash after writing but before recording: a marked K3 line no task claims.
    h.write(&format!("{}\n", mark(K3)));
    add(&h.manager, "a", "alice", &[K1]).await;
    assert_eq!(h.marked().len(), 2, "add never removes");
    remove(&h.manager, "a", "alice", &[]).await;
    assert!(h.marked().is_empty());
}

#[tokio::test]
async fn users_are_separate() {
    let h = Home::new();
    fs_err::create_dir(h.beside("bob")).unwrap();
    add(&h.manager, "a", "alice", &[K1]).await;
    add(&h.manager, "b", "bob", &[K1]).await;
    remove(&h.manager, "a", "alice", &[]).await;
    assert!(h.marked().is_empty());
    assert_eq!(h.read_of("bob"), format!("{}\n", mark(K1)));
}

#[tokio::test]
async fn unknown_or_invalid_user_is_an_error_and_registers_nothing() {
    let h = Home::new();
    let e = add_err(&h.manager, "a", "mallory", &[K1]).await;
    assert!(matches!(e, ResourcesError::UnknownUser { .. }), "{e}");
    for bad in ["../etc", "a/b", ".", "..", "a\nb", "a\rb", "a\0b"] {
        let e = add_err(&h.manager, "a", bad, &[K1]).await;
        let invalid = matches!(e, ResourcesError::InvalidUser { .. });
        assert!(invalid, "{bad:?}: {e}");
    }
    // An empty user with keys fails with a clear error; without keys there is nothing to do.
    let e = add_err(&h.manager, "a", "", &[K1]).await;
    assert!(matches!(e, ResourcesError::MissingUser { keys: 1 }), "{e}");
    assert!(e.to_string().contains("no host user"), "{e}");
    add(&h.manager, "a", "", &[]).await;
    assert!(h.manager.live_tasks().is_empty());
    // Removing keys of a user that does not exist (or could never have been written) is a
    // no-op, so a release recorded ahead of a failed add goes through. Nor is a user without a
    // home (bob) or without ~/.ssh (alice) an error on removal.
    for user in ["mallory", "../etc", "", "bob", "alice"] {
        remove(&h.manager, "a", user, &[K1]).await;
    }
    assert!(!h.home.join(".ssh").exists(), "removal creates nothing");
}

/// At boot a network home, or a directory's users, may come after the shim. Within
/// `USER_GRACE` of its start, removing the keys of a live task (here restored at a restart)
/// whose home or user is not there yet fails, to be retried, and takes them out once the home
/// is there; past the grace, as for a task never live (above), there is nothing to remove.
#[tokio::test]
async fn a_live_tasks_keys_wait_for_a_home_or_user_not_there_yet() {
    let h = Home::new();
    add(&h.manager, "a", "alice", &[K1]).await;
    let unmounted = h.beside("alice-not-mounted");
    fs_err::rename(&h.home, &unmounted).unwrap();
    // A restarted manager's removes of a's keys (alice's home not there) and m's (mallory
    // unknown).
    let removes = async |m: &AuthorizedKeysManager| {
        restore(m, "a", "alice", &[K1]);
        restore(m, "m", "mallory", &[K2]);
        let home = m.remove(&task("a"), "alice", &keys(&[K1])).await;
        (home, m.remove(&task("m"), "mallory", &keys(&[K2])).await)
    };
    let past_grace = h.restarted().with_user_grace(std::time::Duration::ZERO);
    let (home, user) = removes(&past_grace).await;
    assert!(home.is_ok() && user.is_ok(), "{home:?} {user:?}");

    let m = h.restarted();
    let (home, user) = removes(&m).await;
    let home_missing = matches!(home, Err(ResourcesError::HomeMissing { .. }));
    assert!(home_missing, "{home:?}");
    let user_unknown = matches!(user, Err(ResourcesError::UnknownUser { .. }));
    assert!(user_unknown, "{user:?}");
    // A hold of unknown user rewrites every user seen, these two included: not its own lines,
    // so nothing of it waits for them.
    m.hold_unknown(&task("u"), None);
    let unknown = m.remove(&task("u"), "", &[]).await;
    assert!(unknown.is_ok(), "{unknown:?}");
    fs_err::rename(&unmounted, &h.home).unwrap();
    remove(&m, "a", "alice", &[K1]).await;
    let taken_out = !h.read().contains(&mark(K1));
    assert!(taken_out, "taken out once the home is there");
}

#[tokio::test]
async fn any_name_the_passwd_database_knows_is_accepted() {
    // upstream: runner/internal/shim/authorized_keys.go looks any name up with user.Lookup;
    // only names that could reach another path or inject a line are refused before that.
    let tmp = tempfile::tempdir().unwrap();
    let names = [
        "first.last",
        "UPPER",
        "user@corp.example",
        "10001",
        "a-b_c$",
        "x y",
    ];
    let mut db = StaticUserDb::new();
    for n in names {
        let home = tmp.path().join(n.replace(['@', ' ', '$'], "_"));
        fs_err::create_dir(&home).unwrap();
        db = db.with_user(n, home);
    }
    let m = AuthorizedKeysManager::new(Arc::new(db));
    for (i, n) in names.iter().enumerate() {
        add(&m, &format!("t{i}"), n, &[K1]).await;
    }
    assert_eq!(m.live_tasks().len(), names.len());
    // The system database: root exists everywhere, and an odd name is merely unknown.
    let root = shim_resources::SystemUserDb.lookup("root").unwrap();
    assert_eq!(root.uid, 0);
    assert!(matches!(
        shim_resources::SystemUserDb.lookup("no.such.user-4b1d"),
        Err(ResourcesError::UnknownUser { .. })
    ));
}

#[tokio::test]
async fn unknown_hold_keeps_marked_lines_of_unknown_origin_for_its_user() {
    let h = Home::new();
    // Marked lines nobody registered: K3 for alice (an upstream container's, say), K4 for bob.
    h.write(&format!("{K4}\n{}\n", mark(K3)));
    h.write_of("bob", &format!("{}\n", mark(K4)));
    add(&h.manager, "a", "alice", &[K1]).await;
    add(&h.manager, "b", "bob", &[K2]).await;
    h.manager.hold_unknown(&task("up"), Some("alice"));
    // Releasing a: its own key goes (known origin), K3 of unknown origin stays.
    remove(&h.manager, "a", "alice", &[K1]).await;
    assert_eq!(h.marked(), vec![fp(K3)]);
    h.assert_foreign_line_kept();
    // The hold covers alice only: bob's unknown-origin K4 goes with b's removal.
    remove(&h.manager, "b", "bob", &[K2]).await;
    assert_eq!(h.read_of("bob"), "");
    // Releasing the held task clears the hold, and its rewrite prunes the unknown line.
    remove(&h.manager, "up", "alice", &[]).await;
    assert!(h.manager.unknown_holds().is_empty());
    assert!(h.marked().is_empty());
    assert_eq!(h.read(), format!("{K4}\n"));
}

#[tokio::test]
async fn hold_without_user_covers_every_user_until_removed() {
    let h = Home::new();
    h.write_of("bob", &format!("{}\n", mark(K4)));
    h.manager.hold_unknown(&task("lost"), None);
    add(&h.manager, "b", "bob", &[K2]).await;
    remove(&h.manager, "b", "bob", &[K2]).await;
    let msg = "unknown origin kept while a task of unknown user and keys lives";
    assert_eq!(h.read_of("bob"), format!("{}\n", mark(K4)), "{msg}");
    // The held task's keys become known (restore replaces the hold): K4 is no longer
    // protected, and the next rewrite for bob prunes it.
    restore(&h.manager, "lost", "alice", &[K1]);
    assert!(h.manager.unknown_holds().is_empty());
    add(&h.manager, "c", "bob", &[K2]).await;
    remove(&h.manager, "c", "bob", &[K2]).await;
    assert_eq!(h.read_of("bob"), "");
}

/// After a restart: a's keys are known, and it is released; "lost" had its state file
/// unreadable, so neither its user nor its keys are known, and K3 is of unknown origin.
async fn released_beside_a_lost_task() -> Home {
    let h = Home::new();
    h.write(&format!("{K4}\n{}\n{}\n", mark(K1), mark(K3)));
    restore(&h.manager, "a", "alice", &[K1]);
    h.manager.hold_unknown(&task("lost"), None);
    remove(&h.manager, "a", "alice", &[K1]).await;
    assert_eq!(h.marked(), vec![fp(K3)], "kept while the held task lives");
    h
}

#[tokio::test]
async fn lines_kept_for_a_task_of_unknown_user_go_when_it_is_released() {
    let h = released_beside_a_lost_task().await;
    // Its release (the engine passes no user: none is known) rewrites alice's file too.
    remove(&h.manager, "lost", "", &[]).await;
    assert!(h.marked().is_empty(), "{}", h.read());
    assert_eq!(h.read(), format!("{K4}\n"));
}

/// Found in review: a release of a task of unknown user whose rewrite fails keeps its hold, so
/// the engine's retry (which knows neither user nor keys) rewrites the same file once the fault
/// is gone (it used to drop the hold first and then rewrite nothing).
#[tokio::test]
async fn a_failed_release_of_a_task_of_unknown_user_is_redone_by_the_retry() {
    let h = released_beside_a_lost_task().await;
    // alice's ~/.ssh cannot be opened as a directory: the rewrite fails.
    let ssh = h.home.join(".ssh");
    let aside = h.home.join(".ssh-aside");
    fs_err::rename(&ssh, &aside).unwrap();
    fs_err::write(&ssh, "not a directory").unwrap();
    assert!(h.manager.remove(&task("lost"), "", &[]).await.is_err());
    fs_err::remove_file(&ssh).unwrap();
    fs_err::rename(&aside, &ssh).unwrap();
    assert_eq!(h.marked(), vec![fp(K3)], "nothing rewritten yet");
    // The retry, as the engine sends it.
    remove(&h.manager, "lost", "", &[]).await;
    assert_eq!(h.read(), format!("{K4}\n"));
}

#[tokio::test]
async fn restart_with_a_held_task_removes_only_known_keys() {
    let h = Home::new();
    add(&h.manager, "a", "alice", &[K1]).await;
    add(&h.manager, "gone", "alice", &[K2]).await;
    add(&h.manager, "up", "alice", &[K3]).await;
    // Restart: a is live, "up"'s state file is unreadable (keys unknown), "gone" finished.
    let after = h.restarted();
    restore(&after, "a", "alice", &[K1]);
    after.hold_unknown(&task("up"), Some("alice"));
    remove(&after, "gone", "alice", &[K2]).await;
    let msg = "K2 known and released; K3 held";
    assert_eq!(h.marked(), vec![fp(K1), fp(K3)], "{msg}");
    // Add never removes, hold or not.
    add(&after, "d", "alice", &[K4]).await;
    assert_eq!(h.marked(), vec![fp(K1), fp(K3), fp(K4)]);
}

#[tokio::test]
async fn failed_write_registers_nothing_and_changes_nothing() {
    let h = Home::new();
    h.write(&format!("{K4}\n"));
    // A home whose .ssh is a file: every write fails.
    let db = StaticUserDb::new().with_user("alice", h.file());
    let broken = AuthorizedKeysManager::new(Arc::new(db));
    assert!(broken.add(&task("a"), "alice", &[key(K1)]).await.is_err());
    assert!(broken.live_tasks().is_empty());
    assert_eq!(h.read(), format!("{K4}\n"));
}

#[tokio::test]
async fn concurrent_updates_are_serialized() {
    let h = Home::new();
    h.write(&format!("{K4}\n"));
    let lines = [K1, K2, K3];
    let mut handles = Vec::new();
    for i in 0..30 {
        let m = h.manager.clone();
        handles.push(tokio::spawn(async move {
            let t = format!("t{i}");
            add(&m, &t, "alice", &[lines[i % 3]]).await;
            if i % 2 == 0 {
                remove(&m, &t, "alice", &[]).await;
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    // Odd tasks stay: t1 (K2), t3 (K1), t5 (K3), … — every key is held by some odd task.
    let mut marked = h.marked();
    marked.sort();
    let mut want: Vec<String> = lines.map(fp).to_vec();
    want.sort();
    assert_eq!(marked, want);
    h.assert_foreign_line_kept();
}

/// A user's passwd lookup (LDAP, NFS home) that hangs holds up that user's updates only:
/// another user's keys are written meanwhile, and the first user's once it answers. The
/// hanging user's later updates wait without a thread of the blocking pool each: on a pool of
/// two, one hung update and two more of the same user leave room for bob's.
#[test]
fn a_user_whose_home_hangs_holds_up_no_other_user() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(home_hangs());
}

async fn home_hangs() {
    /// Alice's lookups wait until the gate opens.
    struct Hanging {
        db: StaticUserDb,
        gate: std::sync::Mutex<bool>,
        opened: std::sync::Condvar,
        /// Set once alice's lookup waits (her update holds her lock then).
        entered: tokio::sync::watch::Sender<bool>,
    }
    impl shim_resources::UserDb for Hanging {
        fn lookup(&self, user: &str) -> shim_resources::Result<shim_resources::UserEntry> {
            if user == "alice" {
                self.entered.send_replace(true);
                let mut open = self.gate.lock().unwrap();
                while !*open {
                    open = self.opened.wait(open).unwrap();
                }
            }
            self.db.lookup(user)
        }
    }
    let h = Home::new();
    let db = Arc::new(Hanging {
        db: StaticUserDb::new()
            .with_user("alice", &h.home)
            .with_user("bob", h.beside("bob")),
        gate: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
        entered: tokio::sync::watch::Sender::new(false),
    });
    let mut entered = db.entered.subscribe();
    fs_err::create_dir(h.beside("bob")).unwrap();
    let m = AuthorizedKeysManager::new(db.clone());
    let alice = tokio::spawn({
        let m = m.clone();
        async move { add(&m, "a", "alice", &[K1]).await }
    });
    // Alice's update holds her lock once her lookup waits.
    entered.wait_for(|e| *e).await.unwrap();
    let later: Vec<_> = ["a2", "a3"]
        .map(|t| {
            let m = m.clone();
            tokio::spawn(async move { add(&m, t, "alice", &[K4]).await })
        })
        .into();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let bob = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        add(&m, "b", "bob", &[K2]).await;
        remove(&m, "b", "bob", &[K2]).await;
        add(&m, "b2", "bob", &[K3]).await;
    });
    let (bob, alice_waited) = (bob.await, !alice.is_finished());
    *db.gate.lock().unwrap() = true;
    db.opened.notify_all();
    assert!(bob.is_ok(), "bob's updates waited for alice's lookup");
    assert!(alice_waited, "alice's lookup hangs until the gate opens");
    assert!(h.read_of("bob").contains(&mark(K3)));
    alice.await.unwrap();
    for a in later {
        a.await.unwrap();
    }
    assert!(h.read().contains(&mark(K1)) && h.read().contains(&mark(K4)));
}

#[tokio::test]
async fn symlinked_file_or_ssh_dir_is_refused_and_never_followed() {
    #[track_caller]
    fn assert_refused_as_a_link(e: &ResourcesError) {
        let ResourcesError::Fs(shim_fs::FsError::WrongType { found, .. }) = e else {
            panic!("{e}");
        };
        assert_eq!(*found, "a symbolic link", "{e}");
    }
    let h = Home::new();
    let secret = h.beside("secret");
    fs_err::write(&secret, "top secret\n").unwrap();
    // ~/.ssh/authorized_keys → secret.
    fs_err::create_dir(h.home.join(".ssh")).unwrap();
    std::os::unix::fs::symlink(&secret, h.file()).unwrap();
    assert_refused_as_a_link(&add_err(&h.manager, "a", "alice", &[K1]).await);
    assert!(h.manager.live_tasks().is_empty());
    assert_eq!(fs_err::read_to_string(&secret).unwrap(), "top secret\n");
    assert!(!h.home.join(".ssh/authorized_keys.bak").exists());
    // ~/.ssh → another directory.
    fs_err::remove_file(h.file()).unwrap();
    fs_err::remove_dir(h.home.join(".ssh")).unwrap();
    let elsewhere = h.beside("elsewhere");
    fs_err::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, h.home.join(".ssh")).unwrap();
    assert_refused_as_a_link(&add_err(&h.manager, "a", "alice", &[K1]).await);
    assert_eq!(fs_err::read_dir(&elsewhere).unwrap().count(), 0);
}

/// What a write of the file or its backup cut short by a kill left in `~/.ssh` (a temp file
/// holding keys) is removed by the next update of that user's file, once unchanged for ten
/// minutes; a younger one may be another shim's write in flight and stays.
#[tokio::test]
async fn temp_files_of_interrupted_writes_are_removed_once_old() {
    let h = Home::new();
    h.write(&format!("{K4}\n"));
    let ssh = h.home.join(".ssh");
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for (name, old) in [
        (".authorized_keys.tmp-dead.1", true),
        (".authorized_keys.bak.tmp-dead.2", true),
        (".authorized_keys.tmp-other-shim.3", false),
    ] {
        let file = fs_err::File::create(ssh.join(name)).unwrap();
        if old {
            file.file().set_modified(long_ago).unwrap();
        }
    }
    add(&h.manager, "a", "alice", &[K1]).await;
    let mut left: Vec<String> = fs_err::read_dir(&ssh)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    let kept = [
        ".authorized_keys.tmp-other-shim.3",
        "authorized_keys",
        "authorized_keys.bak",
    ];
    assert_eq!(left, kept);
}

#[tokio::test]
async fn planted_temp_file_symlink_is_not_written_through() {
    let h = Home::new();
    h.write(&format!("{K4}\n"));
    let victim = h.beside("victim");
    fs_err::write(&victim, "keep me\n").unwrap();
    let tmp_name = format!(".authorized_keys.tmp-{}", std::process::id());
    std::os::unix::fs::symlink(&victim, h.home.join(".ssh").join(tmp_name)).unwrap();
    add(&h.manager, "a", "alice", &[K1]).await;
    assert_eq!(fs_err::read_to_string(&victim).unwrap(), "keep me\n");
    assert_eq!(h.marked(), vec![K1_FP.to_owned()]);
}

#[tokio::test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
async fn files_are_owned_by_the_user_when_run_as_root() {
    require_root();
    let euid = nix::unistd::geteuid().as_raw();
    assert_eq!(euid, 0, "SHIM_TEST_ROOT=1 needs root");
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("carol");
    fs_err::create_dir(&home).unwrap();
    let entry = shim_resources::UserEntry {
        home: home.clone(),
        uid: 54321,
        gid: 54322,
    };
    let m = AuthorizedKeysManager::new(Arc::new(StaticUserDb::new().with_entry("carol", entry)));
    let ssh = home.join(".ssh");
    let (file, backup) = (ssh.join("authorized_keys"), ssh.join("authorized_keys.bak"));
    let assert_owned_with_mode = |p: &Path, want: u32| {
        let meta = fs_err::metadata(p).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (54321, 54322), "{}", p.display());
        assert_eq!(mode(p), want, "{}", p.display());
    };
    add(&m, "a", "carol", &[K1]).await;
    assert_owned_with_mode(&ssh, 0o700);
    assert_owned_with_mode(&file, 0o600);
    // An existing file keeps its owner and mode through rewrites, and the backup gets them too.
    add(&m, "b", "carol", &[K2]).await;
    assert_owned_with_mode(&file, 0o600);
    assert_owned_with_mode(&backup, 0o600);
}

#[test]
fn ssh_dir_swapped_for_a_link_mid_update_is_never_written_through() {
    // Another thread swaps ~/.ssh and a link to another directory back and forth (atomically,
    // with RENAME_EXCHANGE) while the manager adds and removes keys. Whatever the timing, the
    // manager writes into the real directory or refuses; never through the link (a check of
    // the path followed by a write by path would, whenever the swap lands in between).
    let h = Home::new();
    h.write(&format!("{K4}\n"));
    let elsewhere = h.beside("elsewhere");
    fs_err::create_dir(&elsewhere).unwrap();
    let link = h.home.join(".ssh.swap");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    let ssh = h.home.join(".ssh");
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (stop, swaps, ssh, link) = (stop.clone(), swaps.clone(), ssh.clone(), link.clone());
        std::thread::spawn(move || {
            let exchange = nix::fcntl::RenameFlags::RENAME_EXCHANGE;
            let swap = || nix::fcntl::renameat2(None, &ssh, None, &link, exchange).unwrap();
            while !stop.load(Ordering::Relaxed) {
                swap();
                swaps.fetch_add(1, Ordering::Relaxed);
                // A short sleep, not a spin: on a loaded machine a spinning swapper can be
                // starved with the link in place, and then nothing but refusals is tested.
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            // Leave the real directory at ~/.ssh.
            if ssh.is_symlink() {
                swap();
            }
        })
    };
    let (mut ok, mut refused) = (0, 0);
    let keys = keys(&[K1, K2, K3]);
    // At least 300 rounds, and on until both outcomes were seen under many swaps (bounded).
    let started = std::time::Instant::now();
    for i in 0.. {
        let enough = i >= 300 && ok > 0 && refused > 0 && swaps.load(Ordering::Relaxed) > 100;
        if enough || started.elapsed() > std::time::Duration::from_secs(60) {
            break;
        }
        let t = task(&format!("t{i}"));
        let k = std::slice::from_ref(&keys[i % 3]);
        for r in [
            h.manager.add_blocking(&t, "alice", k),
            h.manager.remove_blocking(&t, "alice", k),
        ] {
            match r {
                Ok(()) => ok += 1,
                Err(ResourcesError::Fs(_)) => refused += 1,
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    let swaps = swaps.load(Ordering::Relaxed);
    eprintln!("{swaps} swaps; {ok} updates done, {refused} refused");
    assert!(swaps > 100 && ok > 0, "the race was not exercised");
    let leaked: Vec<_> = fs_err::read_dir(&elsewhere).unwrap().collect();
    assert!(leaked.is_empty(), "written through the link: {leaked:?}");
    h.assert_foreign_line_kept();
}

/// `render` of a file under a [`Rewrite`]. SPEC §7: key lines are removed only when they
/// belong to a released task and no live task needs them; while a live task's keys are
/// unknown, marked lines of unknown origin stay.
#[test]
fn render_rules() {
    let (m1, m2, m3, m4) = (mark(K1), mark(K2), mark(K3), mark(K4));
    let dup = format!("x\n{m1}\n{m1}\n{m2}\n");
    // The user's own line with K3 (never ours to remove); K1 wanted (a live task), K2
    // released (the task removed), K3 and K4 marked, of unknown origin.
    let held = format!("{K3}\n{m1}\n{m2}\n{m3}\n{m4}\n");
    // Keys the upstream shim added carry no marker; it removes every line with the key
    // (upstream `runner/internal/shim/authorized_keys.go`, `RemovePublicKeys`). A task adopted
    // from an upstream state file releases them the same way, except lines a live task wants.
    let upstream = format!("# a comment\n{K1}\n{K2}\ncommand=\"x\" {K1}\n{m2}\n");
    let (k1, k2, k1_k2, k2_k1) = (keys(&[K1]), keys(&[K2]), keys(&[K1, K2]), keys(&[K2, K1]));
    let cases = [
        // Nothing dropped but the duplicate; wanted keys present.
        (
            "an_add_drops_only_duplicates",
            &dup,
            rewrite(&k1, &[], false, &[]),
            format!("x\n{m1}\n{m2}\n"),
        ),
        (
            "a_removal_without_holds_keeps_the_wanted",
            &dup,
            rewrite(&k1, &[], true, &[]),
            format!("x\n{m1}\n"),
        ),
        (
            "no_unknown_hold_keeps_only_the_wanted",
            &held,
            rewrite(&k1, &k2_k1, true, &[]),
            format!("{K3}\n{m1}\n"),
        ),
        // The released key goes, unknown-origin lines stay, the wanted key stays even though
        // the removed task also had it.
        (
            "a_hold_keeps_unknown_origin_lines",
            &held,
            rewrite(&k1, &k2_k1, false, &[]),
            format!("{K3}\n{m1}\n{m3}\n{m4}\n"),
        ),
        // K1's plain line goes; K2 stays (a live task wants it), as does its marked line; a
        // line with options is not a plain key line and is left alone. Upstream's
        // RemovePublicKeys (runner/internal/shim/authorized_keys.go, ssh.ParseAuthorizedKey)
        // would remove it too; this shim removes only lines that are exactly the key, on
        // purpose.
        (
            "upstream_lines_go_as_upstream_removes_them",
            &upstream,
            rewrite(&k2, &k1_k2, false, &k1_k2),
            format!("# a comment\n{K2}\ncommand=\"x\" {K1}\n{m2}\n"),
        ),
        (
            "without_the_upstream_flag_nothing_unmarked_goes",
            &upstream,
            rewrite(&k2, &k1_k2, false, &[]),
            upstream.clone(),
        ),
    ];
    for (name, old, rw, want) in cases {
        assert_eq!(rendered(old, &rw), want, "{name}");
    }
    let rw = rewrite(&k1, &k2_k1, false, &[]);
    assert!(rw.keeps(&fp(K1)) && !rw.keeps(&fp(K2)) && rw.keeps(&fp(K3)));
    // The marker must be an exact trailing field.
    assert!(parse_marked_line(&format!("{K1}{MARKER}")).is_none());
    assert!(parse_marked_line(&format!("{K1} # added by dstack")).is_none());
    assert!(parse_marked_line(&format!("{K1} {MARKER}")).is_some());
    assert!(parse_marked_line(&format!("garbage {MARKER}")).is_none());
}
