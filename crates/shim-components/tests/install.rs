//! Installs from a real local HTTP server; versions from real executables.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use shim_components::ComponentName::{Runner, Shim};
use shim_components::{
    ComponentInfo, ComponentName, ComponentStatus as Status, Components, ComponentsConfig,
    ComponentsError, binary_version,
};
use shim_util::{SystemCommandRunner, error_chain};

const BOUND: Duration = Duration::from_secs(30);

fn script(version_line: &str) -> String {
    format!("#!/bin/sh\necho \"{version_line}\"\n")
}

/// A tiny HTTP server: `/runner` and `/shim` serve scripts, `/gated` waits for a go signal
/// before answering, `/empty` is empty, anything else is 404.
struct FileServer {
    addr: SocketAddr,
    gate: mpsc::Sender<()>,
}

impl FileServer {
    /// The URL of `path` on this server.
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

fn file_server() -> FileServer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (gate_tx, gate_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut lines = BufReader::new(stream.try_clone().unwrap()).lines();
            let line = lines.next().unwrap().unwrap();
            // The headers, up to the empty line.
            lines.find(|h| h.as_ref().unwrap().is_empty());
            // `GET /runner?sig=secret HTTP/1.1` → `/runner`.
            let path = line.split([' ', '?']).nth(1).unwrap_or("");
            if path == "/stall" {
                // A million bytes announced, ten sent, then nothing (the connection kept).
                std::thread::spawn(move || {
                    let head = "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n";
                    let _ = write!(stream, "{head}0123456789");
                    std::thread::sleep(BOUND);
                });
                continue;
            }
            let (status, body) = match path {
                "/runner" => ("200 OK", script("dstack-runner version 1.2.3")),
                "/runner2" => ("200 OK", script("dstack-runner version 2.0.0")),
                "/shim" => ("200 OK", script("dstack-shim version 0.22.1")),
                "/gated" => {
                    let _ = gate_rx.recv_timeout(BOUND);
                    ("200 OK", script("dstack-runner version 3.0.0"))
                }
                "/empty" => ("200 OK", String::new()),
                "/html" => ("200 OK", "<html>an error page</html>".to_owned()),
                _ => ("404 Not Found", "nope".to_owned()),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    FileServer {
        addr,
        gate: gate_tx,
    }
}

fn components(dir: &Path) -> Components {
    components_with(dir, |_| {})
}

/// The components installed into `dir`, their config changed by `change`.
fn components_with(dir: &Path, change: impl FnOnce(&mut ComponentsConfig)) -> Components {
    let mut config = ComponentsConfig::new(dir.join("bin/dstack-runner"), dir.join("dstack-shim"));
    config.version_timeout = Duration::from_secs(2);
    change(&mut config);
    Components::new(config)
}

/// Writes `body` as the executable `path`.
fn executable(path: &Path, body: &str) {
    fs_err::write(path, body).unwrap();
    fs_err::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Asserts that `e` is `ComponentsError::$kind`.
macro_rules! assert_kind {
    ($e:expr, $kind:ident) => {
        assert!(matches!($e, ComponentsError::$kind { .. }), "{}", $e)
    };
}

/// A temporary directory, a file server and the components installed into the directory.
fn setup() -> (tempfile::TempDir, FileServer, Components) {
    let dir = tempfile::tempdir().unwrap();
    let c = components(dir.path());
    (dir, file_server(), c)
}

async fn wait_idle(c: &Components) {
    tokio::time::timeout(BOUND, c.wait_idle())
        .await
        .expect("installs finish");
}

/// The error of an install of the runner from `url`.
async fn install_err(c: &Components, url: &str) -> ComponentsError {
    c.install(Runner, url).await.unwrap_err()
}

/// A component's status.
async fn status(c: &Components, name: ComponentName) -> Status {
    c.info(name).await.status
}

/// A component's status and version.
async fn state(c: &Components, name: ComponentName) -> (Status, String) {
    let info = c.info(name).await;
    (info.status, info.version)
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs_err::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn nothing_installed() {
    let dir = tempfile::tempdir().unwrap();
    let c = components(dir.path());
    let list = c.list().await;
    let none = |name| ComponentInfo {
        name,
        version: String::new(),
        status: Status::NotInstalled,
    };
    assert_eq!(list, vec![none(Runner), none(Shim)]);
}

#[tokio::test]
async fn installs_in_the_background_atomically() {
    let (dir, server, c) = setup();

    let signed = server.url("/runner?sig=secret");
    c.start_install(Runner, &signed).unwrap();
    wait_idle(&c).await;
    assert_eq!(state(&c, Runner).await, (Status::Installed, "1.2.3".into()));
    let path = dir.path().join("bin/dstack-runner");
    let mode = fs_err::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755);
    assert_eq!(dir_entries(&dir.path().join("bin")), vec!["dstack-runner"]);

    // Upgrade in place.
    c.install(Runner, &server.url("/runner2")).await.unwrap();
    assert_eq!(c.info(Runner).await.version, "2.0.0");

    // The shim, too.
    c.install(Shim, &server.url("/shim")).await.unwrap();
    let list = c.list().await;
    assert_eq!(list[0].name, Runner);
    assert_eq!((list[1].name, list[1].version.as_str()), (Shim, "0.22.1"));
    assert_eq!(list[1].status, Status::Installed);
}

#[tokio::test]
async fn second_install_while_installing_is_a_conflict() {
    let (_dir, server, c) = setup();
    let url = server.url("/gated");
    c.start_install(Runner, &url).unwrap();
    assert_eq!(state(&c, Runner).await, (Status::Installing, "".into()));

    let e = c.start_install(Runner, &url).unwrap_err();
    assert_kind!(e, AlreadyInstalling);
    assert_eq!(e.to_string(), "dstack-runner is already installing");
    // The other component is independent.
    assert_eq!(status(&c, Shim).await, Status::NotInstalled);

    server.gate.send(()).unwrap();
    wait_idle(&c).await;
    assert_eq!(state(&c, Runner).await, (Status::Installed, "3.0.0".into()));
}

/// An install whose caller stops waiting (its future dropped) still runs to its end, and
/// counts as running meanwhile: a second install is a conflict, and `wait_idle` waits for it.
/// Dropped, it used to look finished while its download went on, and a shim's would have
/// skipped the check (and rollback) of the binary it put in place.
#[tokio::test]
async fn an_install_whose_caller_goes_away_runs_to_its_end() {
    let (_dir, server, c) = setup();
    let url = server.url("/gated");
    let waited = tokio::time::timeout(Duration::from_millis(200), c.install(Runner, &url)).await;
    assert!(waited.is_err(), "the gated install answered");
    assert_eq!(status(&c, Runner).await, Status::Installing);
    let e = c.start_install(Runner, &url).unwrap_err();
    assert_kind!(e, AlreadyInstalling);
    server.gate.send(()).unwrap();
    wait_idle(&c).await;
    assert_eq!(state(&c, Runner).await, (Status::Installed, "3.0.0".into()));
}

#[tokio::test]
async fn failed_downloads_leave_the_target_alone() {
    let (dir, server, c) = setup();

    // Nothing installed yet: a failure shows as `error`.
    let e = install_err(&c, &server.url("/missing?token=s3cr3t")).await;
    assert_kind!(e, Download);
    assert!(!format!("{e:?}").contains("s3cr3t"), "{e:?}");
    let missing = server.url("/missing");
    let expected = format!("cannot download dstack-runner from {missing}");
    assert_eq!(e.to_string(), expected);
    assert_eq!(status(&c, Runner).await, Status::Error);

    let e = install_err(&c, &server.url("/empty")).await;
    assert_kind!(e, Size);

    // With a working binary in place, a failed upgrade keeps it.
    c.install(Runner, &server.url("/runner")).await.unwrap();
    install_err(&c, &server.url("/missing")).await;
    assert_eq!(state(&c, Runner).await, (Status::Installed, "1.2.3".into()));
    assert_eq!(dir_entries(&dir.path().join("bin")), vec!["dstack-runner"]);

    // Unreachable server (a port bound and closed at once).
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = install_err(&c, &format!("http://{closed}/runner")).await;
    assert_kind!(e, Download);
}

/// A download that stalls mid-file (its connection kept, nothing more sent) fails once
/// nothing has come for `stall_timeout`, the target untouched, where it used to hold the
/// install, and a shutdown waiting for it, for the whole 20 minutes of `download_timeout`.
#[tokio::test]
async fn a_stalled_download_fails_after_the_stall_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let server = file_server();
    let c = components_with(dir.path(), |c| c.stall_timeout = Duration::from_secs(1));
    let began = std::time::Instant::now();
    let e = tokio::time::timeout(BOUND, install_err(&c, &server.url("/stall")))
        .await
        .expect("the stalled download never failed");
    assert_kind!(e, Body);
    assert!(began.elapsed() < BOUND, "{:?}", began.elapsed());
    assert_eq!(dir_entries(&dir.path().join("bin")), Vec::<String>::new());
}

/// The temp files an interrupted download left beside a component's binary (a shim killed
/// mid-download) are removed at start-up once older than a download may take; a younger one,
/// which another shim sharing the path may still be writing, and other files stay.
#[test]
fn temp_files_of_interrupted_downloads_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    fs_err::create_dir(&bin).unwrap();
    let c = components(dir.path());
    let long_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    for (name, old) in [
        (".dstack-runner.tmp-1-0.0", true),
        (".dstack-runner.tmp-2-0.0", false),
        ("dstack-runner", true),
        ("other", true),
    ] {
        let file = fs_err::File::create(bin.join(name)).unwrap();
        if old {
            file.file().set_modified(long_ago).unwrap();
        }
    }
    let oldest = ".dstack-runner.tmp-1-0.0";
    assert!(shim_fs::is_temp_of("dstack-runner", oldest));
    // The shim's: a temp file of the path itself, and (fetched beside the path before its
    // check) a download a kill left and that download's own temp file.
    for name in [
        ".dstack-shim.tmp-3-0.0",
        ".dstack-shim.download-4-0",
        "..dstack-shim.download-5-0.tmp-5-0.0",
    ] {
        let file = fs_err::File::create(dir.path().join(name)).unwrap();
        file.file().set_modified(long_ago).unwrap();
    }

    assert_eq!(c.remove_interrupted_downloads(), 4);
    let left = [".dstack-runner.tmp-2-0.0", "dstack-runner", "other"];
    assert_eq!(dir_entries(&bin), left);
    let shim_left = dir_entries(dir.path());
    assert!(
        !shim_left.iter().any(|f| f.contains("dstack-shim")),
        "{shim_left:?}"
    );
}

/// A temp file too young for the start-up sweep (a shim killed mid-download, started again
/// seconds later) is removed by a later sweep, once it has aged past a download's time.
#[tokio::test(start_paused = true)]
async fn an_interrupted_download_is_swept_once_it_has_aged() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    fs_err::create_dir(&bin).unwrap();
    let c = components(dir.path());
    let temp = bin.join(".dstack-runner.tmp-9-0.0");
    let file = fs_err::File::create(&temp).unwrap();
    assert_eq!(c.remove_interrupted_downloads(), 0, "too young at start-up");
    let stop = tokio_util::sync::CancellationToken::new();
    let sweeps = tokio::spawn({
        let (c, stop) = (c.clone(), stop.clone());
        async move { c.sweep_interrupted_downloads(stop).await }
    });
    // It ages (a download's time passes).
    let long_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    file.file().set_modified(long_ago).unwrap();
    for _ in 0..100 {
        if !temp.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    assert!(!temp.exists());
    stop.cancel();
    sweeps.await.unwrap();
}

/// A shim download that is the binary an upgrade rolled back within the hour (the rollback
/// record names its digest) is not put at the path systemd starts on a restart or reboot, with
/// no watchdog: the binary in place stays and the component reports `error`, as after the
/// rollback; it installs once the record no longer refuses it. It used to be put in place,
/// refused only by the next shutdown's pre-flight.
#[tokio::test]
async fn a_shim_binary_rolled_back_within_the_hour_is_not_installed_again() {
    use shim_components::upgrade::{RollbackRecord, digest};
    let dir = tempfile::tempdir().unwrap();
    let server = file_server();
    let home = dir.path().join("home");
    fs_err::create_dir(&home).unwrap();
    let c = components_with(dir.path(), |c| c.rollback_home = Some(home.clone()));
    let target = dir.path().join("dstack-shim");
    let failed = dir.path().join("failed");
    fs_err::write(&failed, script("dstack-shim version 0.22.1")).unwrap();
    let failed_digest = digest(&failed).unwrap();
    let mut record = RollbackRecord::now("0.22.1", &failed_digest, "it did not start", "0.22.0");
    record.write(&home).unwrap();
    executable(&target, &script("dstack-shim version 0.22.0"));

    let e = c.install(Shim, &server.url("/shim")).await.unwrap_err();
    assert_kind!(e, Refused);
    assert!(error_chain(&e).contains("it did not start"), "{e}");
    let kept = fs_err::read_to_string(&target).unwrap();
    assert_eq!(kept, script("dstack-shim version 0.22.0"));
    // Reported as after the rollback itself: `error`, no version (the server asks again at
    // its next check, and restarts nothing, the path's binary being the running one).
    assert_eq!(state(&c, Shim).await, (Status::Error, String::new()));
    assert!(c.rolled_back(Shim).is_some());

    record.at_unix -= 3600;
    record.write(&home).unwrap();
    c.install(Shim, &server.url("/shim")).await.unwrap();
    assert_eq!(state(&c, Shim).await, (Status::Installed, "0.22.1".into()));
}

/// A shim download that does not run here (an HTML error page, another architecture) never
/// reaches the path systemd starts (the server, seeing no version, installs again rather than
/// shutting down, so no pre-flight would look at it): it is fetched beside the path, found not
/// to answer `--version` and removed; the binary at the path is the same file as before, and
/// the component reports `error`, as after a rollback. It used to be renamed over the path and
/// the running binary copied back, which a full disk, a crash or a power cut in between left
/// undone.
#[tokio::test]
async fn a_shim_download_that_does_not_run_never_reaches_the_path() {
    use std::os::unix::fs::MetadataExt as _;
    let dir = tempfile::tempdir().unwrap();
    let server = file_server();
    let c = components_with(dir.path(), |c| c.rollback_home = Some(dir.path().into()));
    let target = dir.path().join("dstack-shim");
    let old = script("dstack-shim version 0.22.0");
    executable(&target, &old);
    let inode = fs_err::metadata(&target).unwrap().ino();

    let e = c.install(Shim, &server.url("/html")).await.unwrap_err();
    assert_kind!(e, Unusable);
    assert!(error_chain(&e).contains("does not report a version"), "{e}");
    assert_eq!(
        fs_err::metadata(&target).unwrap().ino(),
        inode,
        "never replaced"
    );
    assert_eq!(fs_err::read_to_string(&target).unwrap(), old);
    let left: Vec<_> = fs_err::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("download"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(state(&c, Shim).await, (Status::Error, String::new()));
    assert!(c.rolled_back(Shim).is_some());

    // A shim that runs is installed as before.
    c.install(Shim, &server.url("/shim")).await.unwrap();
    assert_eq!(state(&c, Shim).await, (Status::Installed, "0.22.1".into()));
}

/// An empty URL is refused up front; a scheme the downloader does not speak fails the install
/// in the background, the target untouched: the component reports what its check finds.
/// upstream: runner/internal/shim/api/handlers.go (ComponentInstallHandler: 400 only for an
/// empty name, an unknown component or an empty url, then the install runs in the
/// background), runner/internal/shim/components/utils.go (downloadFile: the HTTP client
/// refuses the scheme; checkDstackComponent then reads the file's status).
#[tokio::test]
async fn a_url_that_is_not_http_fails_in_the_background() {
    let (dir, server, c) = setup();
    let e = c.start_install(Runner, "").unwrap_err();
    assert_kind!(e, BadUrl);
    assert_eq!(e.to_string(), "cannot install dstack-runner: empty url");
    assert_eq!(status(&c, Runner).await, Status::NotInstalled);

    c.start_install(Runner, "ftp://u:pw@x/y?token=s").unwrap();
    wait_idle(&c).await;
    assert_eq!(state(&c, Runner).await, (Status::Error, "".into()));
    let e = install_err(&c, "file:///bin/sh").await;
    assert_kind!(e, BadUrl);
    let only_http = "cannot install dstack-runner: only http and https are supported";
    assert_eq!(e.to_string(), format!("{only_http}: file:///bin/sh"));
    let e = install_err(&c, "ftp://u:pw@x/y?token=s").await;
    let (got, without_credentials) = (e.to_string(), format!("{only_http}: ftp://x/y"));
    assert_eq!(got, without_credentials, "no credentials in the message");
    assert!(!dir.path().join("bin/dstack-runner").exists());

    // With a working binary in place, it stays installed.
    c.install(Runner, &server.url("/runner")).await.unwrap();
    c.start_install(Runner, "ftp://x/y").unwrap();
    wait_idle(&c).await;
    assert_eq!(state(&c, Runner).await, (Status::Installed, "1.2.3".into()));
}

/// A rolled-back install reports `error` whatever the restored binary answers, until the
/// next install begins.
#[tokio::test]
async fn a_rolled_back_install_reports_error_until_the_next_install() {
    let (_dir, server, c) = setup();
    c.install(Shim, &server.url("/shim")).await.unwrap();
    assert_eq!(status(&c, Shim).await, Status::Installed);
    c.mark_rolled_back(Shim, "it did not start");
    assert_eq!(state(&c, Shim).await, (Status::Error, "".into()));
    assert_eq!(c.rolled_back(Shim).as_deref(), Some("it did not start"));
    let other = status(&c, Runner).await;
    assert_eq!(other, Status::NotInstalled, "the other one is independent");
    c.start_install(Shim, &server.url("/gated")).unwrap();
    assert_eq!(status(&c, Shim).await, Status::Installing);
    assert_eq!(c.rolled_back(Shim), None);
    server.gate.send(()).unwrap();
    wait_idle(&c).await;
    // The gated download is a runner script: not a shim, so `error` from the check.
    assert_eq!(status(&c, Shim).await, Status::Error);
    c.install(Shim, &server.url("/shim")).await.unwrap();
    assert_eq!(status(&c, Shim).await, Status::Installed);
}

/// The version the executable at `path` reports as component `name`.
async fn version(path: &Path, name: &str, timeout: Duration) -> Result<String, ComponentsError> {
    binary_version(&SystemCommandRunner::default(), path, name, timeout).await
}

#[tokio::test]
async fn versions_of_real_executables() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, body: &str| {
        let p = dir.path().join(name);
        executable(&p, body);
        p
    };
    let t = Duration::from_secs(2);
    let ok = write("ok", &script("dstack-runner version 1.2.3"));
    assert_eq!(version(&ok, "dstack-runner", t).await.unwrap(), "1.2.3");

    let silent = write("silent", "#!/bin/sh\necho hello\n");
    let e = version(&silent, "dstack-runner", t).await.unwrap_err();
    let silent_end = "does not report a version: unexpected output \"hello\"";
    assert!(e.to_string().ends_with(silent_end), "{e}");

    let failing = write("failing", "#!/bin/sh\necho boom >&2\nexit 3\n");
    let e = error_chain(&version(&failing, "dstack-runner", t).await.unwrap_err());
    assert!(e.contains("exit status: 3: boom"), "{e}");

    let hanging = write("hanging", "#!/bin/sh\nexec sleep 600\n");
    let e = version(&hanging, "dstack-runner", Duration::from_millis(300)).await;
    let e = error_chain(&e.unwrap_err());
    assert!(e.contains("did not finish within 300ms"), "{e}");

    let not_exec = dir.path().join("plain");
    fs_err::write(&not_exec, script("x version 1")).unwrap();
    assert!(version(&not_exec, "dstack-runner", t).await.is_err());

    // Upstream's rule (runner/internal/shim/components/utils.go, checkDstackComponent): the
    // output is exactly `<component name> version X`; a runner binary is not a shim.
    assert!(version(&ok, "dstack-shim", t).await.is_err());

    // A binary that does not answer its version shows as `error`, and so does a runner
    // binary in the shim's place.
    let c = Components::new(ComponentsConfig::new(&silent, &ok));
    assert_eq!(status(&c, Runner).await, Status::Error);
    assert_eq!(status(&c, Shim).await, Status::Error);
    let shim = write("shim", &script("dstack-shim version 0.22.1"));
    let c = Components::new(ComponentsConfig::new(&ok, &shim));
    assert_eq!(status(&c, Runner).await, Status::Installed);
    assert_eq!(status(&c, Shim).await, Status::Installed);
}

#[tokio::test]
async fn versions_are_cached_per_file_version() {
    let dir = tempfile::tempdir().unwrap();
    let runner = dir.path().join("dstack-runner");
    let counter = dir.path().join("runs");
    let body = |v: &str| {
        format!(
            "#!/bin/sh\necho x >> '{}'\necho 'dstack-runner version {v}'\n",
            counter.display()
        )
    };
    let write = |v: &str| {
        // Replace the file (new inode), as an install does.
        let tmp = dir.path().join("tmp");
        executable(&tmp, &body(v));
        fs_err::rename(&tmp, &runner).unwrap();
    };
    let runs = || fs_err::read_to_string(&counter).map_or(0, |s| s.lines().count());
    write("1.0.0");
    let c = Components::new(ComponentsConfig::new(&runner, dir.path().join("none")));
    assert_eq!(c.info(Runner).await.version, "1.0.0");
    assert_eq!(c.info(Runner).await.version, "1.0.0");
    assert_eq!(runs(), 1, "the second answer comes from the cache");
    write("1.0.1");
    assert_eq!(c.info(Runner).await.version, "1.0.1");
    assert_eq!(runs(), 2);
}
