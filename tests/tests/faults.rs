//! Fault injection (SPEC §4–§5): the shim SIGKILLed at random points of concurrent requests,
//! its Docker daemon frozen, stopped and restarted under running tasks, its home full during
//! each kind of state write, its state files corrupted, the engine's answers lost or late, the
//! engine away for a while. After each fault what the API answered stays true, nothing is
//! leaked or lost (containers, task directories, `authorized_keys` lines, GPU locks), and
//! everything converges without a restart. The scenarios at the end run in the worlds of
//! `world/mod.rs`; the rest needs the binary (a SIGKILL, a frozen daemon, a real full disk).
//! Each test has its own home (so its own owner identity), port and fake GPUs; what it makes is
//! removed however it ends. Waits are bounded; the few timed assertions have generous bounds.
//!
//! Run: `SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1 cargo nextest run -p shim-e2e --test faults
//! --run-ignored all` (root: host users, loop devices, a daemon of the test's own). The random
//! test prints its seed; `SHIM_FAULTS_SEED=<seed>` replays its choices (thread timing varies).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test code: a failed unwrap is a failed test; figures and logs go to stderr"
)]

mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shim_e2e::harness::{
    FAKE_GPUS, HostUser, LoopFs, PrivateDocker, RemoveImage, Request, Response, ShimProcess,
    TestShim, bridge_task, container_name_of, docker_at, docker_socket, entries, fake_gpu_ids,
    free_port, run_tag, shim_binary, ssh_key, status_of, task_entries, try_docker_within, wait_for,
    wait_until, write_runner_exit,
};
use shim_e2e::{registry, registry_password, registry_user, require_docker, require_root};
use world::{cid, gpu_ids};

/// Bound of the waits for a status or for convergence (never a timed assertion: generous,
/// only there so that a hang fails).
const WAIT: Duration = Duration::from_secs(60);
/// What the kernel's ENOSPC reads as in an error chain.
const ENOSPC: &str = "No space left on device";

// Gating ------------------------------------------------------------------------------------------

/// The first statement of each test: Docker (and with `root`, root) asked for and there.
#[track_caller]
fn require(root: bool) {
    // The test harness names each test's thread after the test.
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_owned();
    require_docker();
    if root {
        require_root();
    }
    let info = try_docker_within(&["info", "--format", "{{.ID}}"], Duration::from_secs(60));
    assert!(
        info.as_ref().is_ok_and(|o| o.status.success()),
        "{test}: SHIM_TEST_DOCKER=1 but Docker does not answer (run `cargo xtask dev-env`): \
         {info:?}"
    );
    if root {
        let uid = shim_e2e::harness::host::run_ok("id", &["-u"]);
        assert_eq!(uid.trim(), "0", "{test}: SHIM_TEST_ROOT=1 but not root");
    }
}

/// The test's own directory (its shim's home and logs, and whatever else it makes).
fn temp_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("shim-faults-").tempdir();
    dir.unwrap()
}

// Task configs ------------------------------------------------------------------------------------

/// A task config as the server sends it: bridge mode, the local test image.
/// Task `id` named `flt-<id>-<run tag>` (container names unique to this run).
fn task(id: &str, gpu: i64) -> Value {
    bridge_task(id, &format!("flt-{id}-{}", run_tag()), gpu)
}

/// `config` with host SSH keys for `user`.
fn with_host_keys(mut config: Value, user: &str, keys: &[&str]) -> Value {
    config["host_ssh_user"] = json!(user);
    config["host_ssh_keys"] = json!(keys);
    config
}

/// The base64 field of a key line (what identifies the key).
fn key_blob(line: &str) -> String {
    line.split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

/// `Ok` if `done`, else `why`: a probe of [`wait_for`].
fn ok_if(done: bool, why: impl std::fmt::Display) -> Result<(), String> {
    if done { Ok(()) } else { Err(why.to_string()) }
}

/// Status, termination reason and message, and container of a TaskInfo.
fn ending(info: &Value) -> [&str; 4] {
    [
        "status",
        "termination_reason",
        "termination_message",
        "container_id",
    ]
    .map(|f| info[f].as_str().unwrap_or("?"))
}

// A host user's authorized_keys -------------------------------------------------------------------

/// The keys (base64 fields) of the lines the shim wrote in the user's `authorized_keys`.
fn marked_keys(user: &HostUser) -> BTreeSet<String> {
    world::HostKeys {
        user: user.name().to_owned(),
        file: user.authorized_keys(),
    }
    .marked()
}

/// Nothing of the shim's tasks is left: no task, container, task directory, or (with `user`)
/// marked key line.
#[track_caller]
fn assert_nothing_left(shim: &TestShim, user: Option<&HostUser>) {
    let keys = user.map(marked_keys).unwrap_or_default();
    let left = (
        shim.list(),
        shim.containers(),
        task_entries(&shim.tasks_dir()),
        keys,
    );
    let what = "left: (tasks, containers, task directories, marked key lines)";
    assert_eq!(left, Default::default(), "{what}");
}

// A TCP proxy that holds connections until it is opened -------------------------------------------

/// Accepts connections on a loopback port and forwards them to `upstream` once opened: a
/// registry behind it makes a pull that waits as long as the test wants.
struct GatedProxy {
    port: u16,
    gate: Arc<(Mutex<bool>, Condvar)>,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl GatedProxy {
    fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (gate, accepted, stop) = (gate.clone(), accepted.clone(), stop.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let gate = gate.clone();
                    std::thread::spawn(move || {
                        let (lock, opened) = &*gate;
                        let mut open = lock.lock().unwrap();
                        while !*open {
                            open = opened.wait(open).unwrap();
                        }
                        drop(open);
                        if let Ok(server) = TcpStream::connect(upstream) {
                            pipe(client, server);
                        }
                    });
                }
            });
        }
        Self {
            port,
            gate,
            accepted,
            stop,
        }
    }

    fn open(&self) {
        let (lock, opened) = &*self.gate;
        *lock.lock().unwrap() = true;
        opened.notify_all();
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for GatedProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.open();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Copies both ways between two connections until both ends are closed.
fn pipe(a: TcpStream, b: TcpStream) {
    let (a2, b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
    let one = std::thread::spawn(move || copy_then_close(a, b2));
    copy_then_close(b, a2);
    let _ = one.join();
}

fn copy_then_close(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

// A seeded PRNG -----------------------------------------------------------------------------------

/// SplitMix64: small, seeded, good enough to pick delays and operations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The seed: `SHIM_FAULTS_SEED`, else the clock.
fn seed() -> u64 {
    match std::env::var("SHIM_FAULTS_SEED") {
        Ok(s) if !s.is_empty() => s.parse().expect("SHIM_FAULTS_SEED is a u64"),
        _ => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    }
}

// 1. SIGKILL at random points of concurrent submit / terminate / remove ---------------------------

/// Rounds of the random test (each ends with a SIGKILL and a restart).
const ROUNDS: u32 = 25;
/// Clients sending requests at once.
const WORKERS: usize = 3;
/// Tasks the clients keep at most (not yet removed).
const MAX_LIVE: usize = 8;

/// What the random test knows of one task.
#[derive(Debug, Clone, Default)]
struct Tracked {
    /// The submit was answered 200 (false: no answer came, the task may or may not exist).
    submitted: bool,
    /// A terminate answered 200 with this reason and message.
    terminated: Option<(String, String)>,
    /// A remove got no answer (it may have happened).
    remove_unanswered: bool,
    /// GPUs it asked for.
    gpu: u64,
    /// A request about it is in flight (one at a time per task).
    busy: bool,
}

/// The random test's book: every task, what the shim answered, and what went wrong.
#[derive(Default)]
struct Book {
    tasks: BTreeMap<String, Tracked>,
    /// Removed after a 200 remove, or found gone after an unanswered one: never seen again.
    removed: BTreeSet<String>,
    /// Submits without an answer that the restarted shim did not know: never seen again.
    never: BTreeSet<String>,
    errors: Vec<String>,
    /// Answers by kind, for the report.
    counts: BTreeMap<String, usize>,
    next: u64,
}

/// One request of the random test: its kind (`submit`, `terminate` or `remove`) and task.
#[derive(Debug)]
struct Op {
    kind: &'static str,
    id: String,
    request: Request,
}

impl Op {
    fn new(kind: &'static str, id: String, request: Request) -> Self {
        let request = request.timeout(Duration::from_secs(60));
        Self { kind, id, request }
    }
}

impl Book {
    /// Picks the next request of worker `w` (and marks its task busy), or `None` if every
    /// task is busy.
    fn choose(&mut self, rng: &mut Rng, round: u32, w: usize, user: &str) -> Option<Op> {
        let idle: Vec<String> = self
            .tasks
            .iter()
            .filter(|(_, t)| !t.busy)
            .map(|(id, _)| id.clone())
            .collect();
        let r = rng.below(100);
        let op = if self.tasks.len() < MAX_LIVE && (r < 45 || idle.is_empty()) {
            self.next += 1;
            let id = format!("k{round:02}w{w}n{}", self.next);
            let gpu = rng.below(3);
            let key = ssh_key(&id);
            let config = with_host_keys(task(&id, gpu as i64), user, &[&key]);
            let tracked = Tracked {
                gpu,
                ..Tracked::default()
            };
            self.tasks.insert(id.clone(), tracked);
            Op::new("submit", id, Request::post("/api/tasks").json(&config))
        } else if idle.is_empty() {
            return None;
        } else {
            let id = idle[rng.below(idle.len() as u64) as usize].clone();
            // A terminated task is mostly removed (now and then terminated again: the first
            // reason stays); a running one mostly terminated (now and then removed: 409).
            let terminated = self.tasks[&id].terminated.is_some();
            if rng.below(10) < if terminated { 7 } else { 2 } {
                let remove = Request::post(&format!("/api/tasks/{id}/remove"));
                Op::new("remove", id, remove)
            } else {
                let reason = ["terminated_by_user", "terminated_by_server"][rng.below(2) as usize];
                let message = format!("stop {} (round {round}, worker {w})", self.next);
                self.next += 1;
                let request = TestShim::terminate_request(&id, reason, &message, rng.below(2));
                Op::new("terminate", id, request)
            }
        };
        self.tasks.get_mut(&op.id).unwrap().busy = true;
        Some(op)
    }

    /// Records the outcome of `op`; `killed`: the shim had been killed when it came.
    fn record(&mut self, op: &Op, result: std::io::Result<Response>, killed: bool) {
        let id = op.id.clone();
        let t = self.tasks.get_mut(&id).unwrap();
        t.busy = false;
        let outcome = match &result {
            Ok(r) => format!("{} {}", op.kind, r.status),
            Err(_) => format!("{} unanswered", op.kind),
        };
        *self.counts.entry(outcome).or_default() += 1;
        let r = match result {
            Ok(r) => r,
            Err(e) => {
                if !killed {
                    self.errors
                        .push(format!("{op:?}: no answer while the shim was running: {e}"));
                }
                if op.kind == "remove" {
                    t.remove_unanswered = true;
                }
                return;
            }
        };
        // Within a round every task is known to exist (the previous check resolved the
        // doubtful ones), so anything but these answers is wrong.
        let json = r.json().ok();
        match (op.kind, r.status) {
            // Submit answers in the Go field names of upstream's runner TaskInfo.
            ("submit", 200) if json.as_ref().is_some_and(|j| j["Status"] == "pending") => {
                t.submitted = true;
            }
            ("terminate", 200) => {
                let info = json.unwrap_or_default();
                let [status, reason, message, _] = ending(&info);
                let got = (reason.to_owned(), message.to_owned());
                if status != "terminated" {
                    self.errors
                        .push(format!("{op:?}: answered 200 but not terminated: {info}"));
                } else if let Some(first) = &t.terminated
                    && *first != got
                {
                    self.errors.push(format!(
                        "{op:?}: the first answered reason {first:?} became {got:?}"
                    ));
                } else {
                    t.terminated = Some(got);
                }
            }
            ("remove", 200) if r.body == "\n" => {
                self.tasks.remove(&id);
                self.removed.insert(id);
            }
            // Not terminated yet, or its start / a release is still settling.
            ("remove", 409) => {}
            _ => self.errors.push(format!("{op:?}: unexpected answer {r:?}")),
        }
    }
}

/// One client of the random test: requests until the shim is killed.
fn client(
    addr: SocketAddr,
    book: &Mutex<Book>,
    killed: &AtomicBool,
    user: &str,
    round: u32,
    w: usize,
    mut rng: Rng,
) {
    while !killed.load(Ordering::SeqCst) {
        let op = book.lock().unwrap().choose(&mut rng, round, w, user);
        let Some(op) = op else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        let result = op.request.send(addr);
        let killed_now = killed.load(Ordering::SeqCst);
        book.lock().unwrap().record(&op, result, killed_now);
        std::thread::sleep(Duration::from_millis(rng.below(15)));
    }
}

/// After a restart: what the shim answered before the kill is still true.
fn check_answers_survived(shim: &TestShim, book: &mut Book, round: u32) {
    assert!(
        book.errors.is_empty(),
        "round {round}: wrong answers:\n{}",
        book.errors.join("\n")
    );
    let list = shim.list();
    for id in list.keys() {
        assert!(
            book.tasks.contains_key(id),
            "round {round}: task {id} is listed, but it was removed after a 200 remove ({}), \
             or its unanswered submit was already found gone ({}), or it was never submitted",
            book.removed.contains(id),
            book.never.contains(id)
        );
    }
    let ids: Vec<String> = book.tasks.keys().cloned().collect();
    for id in ids {
        let listed = list.contains_key(&id);
        let t = book.tasks.get_mut(&id).unwrap();
        if t.remove_unanswered {
            t.remove_unanswered = false;
            if !listed {
                book.tasks.remove(&id);
                book.removed.insert(id);
                continue;
            }
        }
        if !t.submitted {
            if listed {
                t.submitted = true;
            } else {
                book.tasks.remove(&id);
                book.never.insert(id);
                continue;
            }
        }
        assert!(
            listed,
            "round {round}: task {id} was submitted (answered 200) and is lost after the restart"
        );
        if let Some((reason, message)) = &t.terminated {
            assert_has!(
                shim.info(&id),
                {"status": "terminated", "termination_reason": reason,
                 "termination_message": message},
                "round {round}: task {id} was terminated (answered 200) and lost its reason \
                 across the restart:"
            );
        }
    }
}

/// What must hold once the shim settled after a restart (or `Err` with what does not yet):
/// every task running or terminated; a running task's container runs and a terminated one's
/// does not; no container but the tasks'; the marked `authorized_keys` lines are exactly the
/// keys of the running tasks; the task directories are exactly the tasks' (no trash, no
/// skeleton). Returns the tasks' infos.
fn settled(shim: &TestShim, user: &HostUser) -> Result<BTreeMap<String, Value>, String> {
    let infos: BTreeMap<String, Value> = shim
        .list()
        .keys()
        .map(|id| (id.clone(), shim.info(id)))
        .collect();
    let mut problems = Vec::new();
    let containers = shim.containers();
    let names: BTreeSet<String> = infos
        .values()
        .map(|i| i["container_name"].as_str().unwrap().to_owned())
        .collect();
    let mut want_keys = BTreeSet::new();
    for (id, info) in &infos {
        let name = info["container_name"].as_str().unwrap();
        let running = containers.get(name).map(|c| c.1);
        match status_of(info) {
            "running" => {
                want_keys.insert(key_blob(&ssh_key(id)));
                if running != Some(true) {
                    problems.push(format!("{id} is running, its container is {running:?}"));
                }
            }
            "terminated" => {
                if running == Some(true) {
                    problems.push(format!("{id} is terminated, its container still runs"));
                }
            }
            other => problems.push(format!("{id} is {other}")),
        }
    }
    let leaked: Vec<&String> = containers.keys().filter(|n| !names.contains(*n)).collect();
    if !leaked.is_empty() {
        problems.push(format!("containers of no task: {leaked:?}"));
    }
    let marked = marked_keys(user);
    if marked != want_keys {
        problems.push(format!(
            "authorized_keys: lines of no running task {:?}, keys of running tasks missing {:?}",
            marked.difference(&want_keys).collect::<Vec<_>>(),
            want_keys.difference(&marked).collect::<Vec<_>>()
        ));
    }
    let dirs = task_entries(&shim.tasks_dir());
    if dirs != names {
        problems.push(format!(
            "task directories of no task {:?}, tasks without a directory {:?}",
            dirs.difference(&names).collect::<Vec<_>>(),
            names.difference(&dirs).collect::<Vec<_>>()
        ));
    }
    if problems.is_empty() {
        Ok(infos)
    } else {
        Err(problems.join("; "))
    }
}

/// The GPUs of the running tasks do not overlap and are what each asked for, and every other
/// GPU is free: a task asking for all of the rest gets exactly them.
fn check_gpus(
    shim: &TestShim,
    infos: &BTreeMap<String, Value>,
    asked: &dyn Fn(&str) -> u64,
    probe: &str,
) {
    let mut used = BTreeSet::new();
    for (id, info) in infos.iter().filter(|(_, i)| status_of(i) == "running") {
        let gpus = gpu_ids(info);
        assert_eq!(gpus.len() as u64, asked(id), "{id}: {info}");
        assert!(
            gpus.is_disjoint(&used),
            "{id} holds a GPU another running task holds: {info}"
        );
        used.extend(gpus);
    }
    let free: BTreeSet<String> = fake_gpu_ids().difference(&used).cloned().collect();
    if free.is_empty() {
        return;
    }
    let r = shim.submit(&task(probe, free.len() as i64));
    assert_eq!(r.status, 200, "{r:?}");
    let info = shim.wait_status(probe, "running");
    assert_eq!(gpu_ids(&info), free, "the free GPUs: {info}");
    shim.finish(probe);
}

/// SPEC §4–§5 under crashes: 25 rounds of three clients sending submits, terminates and
/// removes at once, ended by a SIGKILL after a short random delay, then a restart on the same
/// home. After each restart: every submit answered 200 is still known (unless removed after a
/// 200 remove), every terminate answered 200 keeps its reason and message, and once the shim
/// settles nothing is leaked or lost (containers, task directories, `authorized_keys` lines of
/// a real user, GPU locks of four fake GPUs). At the end everything is terminated and
/// removed, leaving no container, no task directory, no trash and no marked key line.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn sigkill_at_random_points_of_concurrent_requests_loses_nothing() {
    require(true);
    let seed = seed();
    eprintln!("seed {seed} (SHIM_FAULTS_SEED={seed} replays the choices)");
    let started = Instant::now();
    let mut rng = Rng(seed);
    let dir = temp_dir();
    let user = HostUser::create(dir.path());
    // A line of the user's own: never touched.
    let own = ssh_key("own@faults");
    user.add_line(&own);
    let mut shim = TestShim::builder("faults")
        .home(&dir.path().join("home"), &dir.path().join("logs"))
        .build();
    shim.start();
    let book = Mutex::new(Book::default());
    for round in 0..ROUNDS {
        let killed = AtomicBool::new(false);
        // Now and then right after the start, mostly while requests are in full swing.
        let delay = if rng.below(5) == 0 {
            rng.below(50)
        } else {
            50 + rng.below(550)
        };
        let addr = shim.addr();
        std::thread::scope(|s| {
            for w in 0..WORKERS {
                let client_rng = Rng(rng.next());
                let (book, killed, user) = (&book, &killed, user.name());
                s.spawn(move || client(addr, book, killed, user, round, w, client_rng));
            }
            std::thread::sleep(Duration::from_millis(delay));
            killed.store(true, Ordering::SeqCst);
            shim.kill();
        });
        shim.start();
        let mut b = book.lock().unwrap();
        check_answers_survived(&shim, &mut b, round);
        let infos = wait_for(&format!("round {round}: settled"), WAIT, || {
            settled(&shim, &user)
        });
        let asked = |id: &str| b.tasks[id].gpu;
        check_gpus(&shim, &infos, &asked, &format!("probe{round:02}"));
        assert!(user.lines().contains(&own), "the user's own line is gone");
    }

    // Everything can be terminated and removed; nothing is left.
    let ids: Vec<String> = shim.list().into_keys().collect();
    for id in &ids {
        let r = shim.terminate(id, "terminated_by_server", "the end", 0);
        assert_eq!(r.status, 200, "{r:?}");
    }
    for id in &ids {
        shim.remove_retrying(id);
    }
    assert_eq!(shim.list(), BTreeMap::new());
    let all = task("all-gpus", FAKE_GPUS as i64);
    assert_eq!(shim.submit(&all).status, 200);
    let info = shim.wait_status("all-gpus", "running");
    assert_eq!(gpu_ids(&info), fake_gpu_ids(), "every GPU is free: {info}");
    shim.finish("all-gpus");
    assert_nothing_left(&shim, Some(&user));
    assert_eq!(
        user.lines(),
        vec![own],
        "the user's own line is all that is left"
    );
    let b = book.lock().unwrap();
    eprintln!(
        "MEASURED {ROUNDS} rounds in {:?}: {} tasks removed, {} unanswered submits never \
         existed; answers: {:?}",
        started.elapsed(),
        b.removed.len(),
        b.never.len(),
        b.counts
    );
}

// 2. Docker frozen, stopped and restarted under running tasks -------------------------------------

/// A shim that starts while Docker does not answer yet (restarted by an operator or a package
/// upgrade; an upgrade in place's new binary, whose watchdog would otherwise roll it back for
/// Docker's doing) waits for it, as its start-up list does, and serves once it answers. It
/// used to exit at once: `cannot connect to the Docker daemon`.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn a_shim_started_before_docker_answers_waits_for_it() {
    require_docker();
    let dir = temp_dir();
    let socket = dir.path().join("docker.sock");
    let mut shim = TestShim::builder("faults")
        .home(&dir.path().join("home"), &dir.path().join("logs"))
        .docker_host(&format!("unix://{}", socket.display()))
        .build();
    let appears = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        std::os::unix::fs::symlink(docker_socket(), &socket).unwrap();
    });
    let started = Instant::now();
    shim.start();
    appears.join().unwrap();
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert_eq!(shim.submit(&task("t1", 0)).status, 200);
    shim.wait_status("t1", "running");
    shim.finish("t1");

    // A stop while it waits is a stop: it exits at once, successfully, as after any signal.
    let never = format!("unix://{}", dir.path().join("never.sock").display());
    let env = [("DOCKER_HOST", std::ffi::OsStr::new(&never))];
    let log = dir.path().join("waiting.log");
    let args = ["--runner-binary-path", "/bin/true"];
    let home = dir.path().join("home-2");
    let port = free_port().unwrap();
    let waiting = ShimProcess::spawn_with_env(shim_binary(), &home, port, &args, &env, &log);
    let waiting = waiting.unwrap();
    wait_until("the shim waits for Docker", Duration::from_secs(30), || {
        fs_err::read_to_string(&log).is_ok_and(|l| l.contains("does not answer yet"))
    });
    waiting.sigterm().unwrap();
    let status = waiting.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(
        status.success(),
        "{status}: {}",
        fs_err::read_to_string(&log).unwrap()
    );
}

/// Runs `f`, an API request answered from memory, and asserts that it did not wait for the
/// frozen daemon: a request that waited on Docker would only come back once the runtime's
/// bound on a Docker call (30 s) gave up. A hang detector, not a speed target.
fn without_docker<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    let took = started.elapsed();
    assert!(
        took < DOCKER_CALL_BOUND,
        "{what} took {took:?}: the API must not wait on Docker"
    );
    out
}

/// The runtime's bound on a Docker call's answer to begin (shim-runtime, docker/mod.rs).
const DOCKER_CALL_BOUND: Duration = Duration::from_secs(30);

/// The last line of a terminated task's message.
fn last_line(info: &Value) -> String {
    info["termination_message"]
        .as_str()
        .unwrap_or_default()
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned()
}

/// SPEC §4 (reconciler) against a Docker daemon of the test's own, with running tasks:
/// - frozen (SIGSTOP): task info and the list answer at once; a terminate answers within its
///   grace period and a few seconds (the stop goes on in the background) with the durable
///   `terminated`; a runner that exits meanwhile is not seen yet;
/// - thawed (SIGCONT): everything converges without a restart of the shim: the stop is done,
///   the exit is reported with its code;
/// - restarted (stop + start, live restore keeps the containers): the event stream
///   reconnects, the shim relists, and an exit that happened while the daemon was down is
///   reported with its exit code; a task that kept running is untouched.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn docker_frozen_stopped_and_restarted_under_running_tasks() {
    require(true);
    let dir = temp_dir();
    let mut daemon = PrivateDocker::start(&dir.path().join("docker"));
    let mut shim = TestShim::builder("faults")
        .home(&dir.path().join("home"), &dir.path().join("logs"))
        .docker_host(daemon.host())
        .build();
    shim.start();
    // a: terminated while frozen; b: exits (5) while frozen; c and e: exit (0 and 3) while
    // the daemon is down; d: runs throughout.
    let ids = ["a", "b", "c", "d", "e"];
    let mut infos = BTreeMap::new();
    for (id, gpu) in [("a", 1), ("b", 1), ("c", 0), ("d", 1), ("e", 0)] {
        assert_eq!(shim.submit(&task(id, gpu)).status, 200);
    }
    for id in ids {
        infos.insert(id, shim.wait_status(id, "running"));
    }
    let cid = |id: &str| infos[id]["container_id"].as_str().unwrap().to_owned();

    // Frozen.
    daemon.freeze();
    for _ in 0..3 {
        without_docker("task info (daemon frozen)", || shim.info("d"));
        without_docker("the list (daemon frozen)", || shim.list());
    }
    write_runner_exit(shim.home(), &infos["b"], 5).unwrap();
    let started = Instant::now();
    let r = shim.terminate("a", "terminated_by_user", "while frozen", 2);
    let took = started.elapsed();
    assert_eq!(r.status, 200, "{r:?}");
    let answered = r.json().unwrap();
    let end = ["terminated", "terminated_by_user", "while frozen"];
    assert_eq!(ending(&answered)[..3], end, "{answered}");
    eprintln!("MEASURED terminate (timeout 2 s) with the daemon frozen answered in {took:?}");
    // Waiting for Docker's stop would take the grace period plus the stop call's own bound
    // (60 s more): the shim gives up on the frozen daemon well before that.
    assert!(
        took < DOCKER_CALL_BOUND,
        "terminate with the daemon frozen took {took:?}"
    );
    assert_eq!(without_docker("task info", || shim.info("a")), answered);
    let list = without_docker("the list", || shim.list());
    assert_eq!(
        list["b"], "running",
        "the daemon could not tell yet: {list:?}"
    );
    // Still frozen: the container the stop was sent for may not have stopped.
    daemon.thaw();

    // Converges without a restart.
    wait_for("a stopped, b's exit reported", WAIT, || {
        let b = shim.info("b");
        ok_if(
            shim.running(&cid("a")) == Some(false),
            "a's container still runs",
        )?;
        ok_if(status_of(&b) == "terminated", format!("b: {b}"))
    });
    let b = shim.info("b");
    assert_has!(b, {"termination_reason": "container_exited_with_error"});
    assert_eq!(last_line(&b), "runner exiting with 5", "{b}");
    assert_eq!(shim.info("a"), answered, "a keeps its reason");
    for id in ["c", "d", "e"] {
        assert_eq!(status_of(&shim.info(id)), "running", "{id}");
    }

    // Restarted: c's and e's runners exit while the daemon is down.
    let reconnects = || {
        let logs = shim.all_logs();
        logs.matches("event stream connected; relisting").count()
    };
    let reconnects_before = reconnects();
    daemon.stop();
    without_docker("task info (daemon down)", || shim.info("c"));
    write_runner_exit(shim.home(), &infos["c"], 0).unwrap();
    write_runner_exit(shim.home(), &infos["e"], 3).unwrap();
    // The stub runner polls its exit file every 100 ms.
    std::thread::sleep(Duration::from_millis(1500));
    daemon.start_daemon();
    wait_for(
        "c's and e's exits reported after the daemon restart",
        WAIT,
        || {
            let (c, e) = (shim.info("c"), shim.info("e"));
            let ended = status_of(&c) == "terminated" && status_of(&e) == "terminated";
            ok_if(ended, format!("{c} {e}"))
        },
    );
    // What a container prints while the daemon is down is lost (Docker reads its output), so
    // the exit codes tell: 0 is done, 3 an error, and the shim saw 3.
    assert_has!(shim.info("c"), {"termination_reason": "done_by_runner"});
    assert_has!(shim.info("e"), {"termination_reason": "container_exited_with_error"});
    assert!(
        shim.all_logs()
            .contains("task=e observation=Exited { code: 3,"),
        "e's exit code 3:\n{}",
        shim.log_tail()
    );
    assert_has!(shim.info("d"), {"status": "running", "container_id": infos["d"]["container_id"]});
    assert_eq!(shim.running(&cid("d")), Some(true));
    assert!(
        reconnects() > reconnects_before,
        "the event stream did not reconnect:\n{}",
        shim.log_tail()
    );

    for id in ids {
        shim.finish(id);
    }
    assert_nothing_left(&shim, None);
}

// 3. The home fills up ----------------------------------------------------------------------------

/// What a full home means beyond `a_full_home_fails_writes_with_their_cause_and_converges_when_freed`
/// (below, in every world), which only the binary on a real full disk with real keys shows.
/// The home is on a 16 MiB ext4 filesystem that fills up (ENOSPC):
/// - a start that reaches its container while full is not given up: the pull's end, the
///   create, the start and `running` are start progress and need no write of their own, so
///   its container runs and the task shows `running` at once (the container proves it), its
///   record staying `pulling` (written before the pull) even once space returns;
/// - a terminate stops the container and releases the task's `authorized_keys` line although
///   its record cannot be written (issue 22), and so does a runner's exit (`done_by_runner`).
///
/// Once space returns, without a restart, the terminations are written and the keys are all
/// gone; after a restart the started task runs on in its container.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn on_a_full_home_a_start_runs_and_keys_go_before_their_records() {
    require(true);
    let dir = temp_dir();
    let fs = LoopFs::create(dir.path(), 16);
    let user = HostUser::create(dir.path());
    let mut shim = TestShim::builder("faults")
        .home(&fs.mount.join("home"), &dir.path().join("logs"))
        .build();
    shim.start();

    // t1: terminated while full; t2: its runner exits while full. Both hold a key.
    let k1 = ssh_key("t1@faults");
    let k2 = ssh_key("t2@faults");
    for (id, key) in [("t1", &k1), ("t2", &k2)] {
        let config = with_host_keys(task(id, 1), user.name(), &[key]);
        assert_eq!(shim.submit(&config).status, 200);
    }
    let t1 = shim.wait_status("t1", "running");
    let t2 = shim.wait_status("t2", "running");
    let t1_cid = t1["container_id"].as_str().unwrap().to_owned();
    let t2_cid = t2["container_id"].as_str().unwrap().to_owned();
    shim_e2e::harness::stage_runner_exit(shim.home(), &t2, 0).unwrap();

    // t4: its pull waits behind a gated proxy of the test registry, so its start is held in
    // `pulling` until the disk is full; its next status write then fails.
    let proxy = GatedProxy::start(registry().parse().unwrap());
    let pulled = format!(
        "127.0.0.1:{}/{}:{}",
        proxy.port,
        shim_e2e::REGISTRY_SMALL_REPO,
        shim_e2e::REGISTRY_TAG
    );
    let _pulled_image = RemoveImage(pulled.clone());
    let mut t4_config = task("t4", 0);
    t4_config["image_name"] = json!(pulled);
    t4_config["registry_username"] = json!(registry_user());
    t4_config["registry_password"] = json!(registry_password());
    assert_eq!(shim.submit(&t4_config).status, 200);
    wait_for("t4 pulling through the proxy", WAIT, || {
        let (t4, accepted) = (shim.info("t4"), proxy.accepted());
        ok_if(
            status_of(&t4) == "pulling" && accepted > 0,
            format!("{t4}, {accepted} connections"),
        )
    });
    assert_eq!(marked_keys(&user), [&k1, &k2].map(|k| key_blob(k)).into());

    let filler = fs.fill();

    // A terminate: the container stopped and the key released although nothing is written.
    let r = shim.terminate("t1", "terminated_by_user", "first", 0);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(shim.running(&t1_cid), Some(false), "t1's container stops");
    assert!(
        !marked_keys(&user).contains(&key_blob(&k1)),
        "t1's key is released"
    );

    // An exit: reported at once, its key released, its record waiting.
    write_runner_exit(shim.home(), &t2, 0).unwrap();
    wait_until("t2's container exits", WAIT, || {
        shim.running(&t2_cid) == Some(false)
    });
    let exited = Instant::now();
    let what = "t2 reads terminated and its key goes, the disk full";
    wait_for(what, WAIT, || {
        let (t2, marked) = (shim.info("t2"), marked_keys(&user));
        let released = !marked.contains(&key_blob(&k2));
        let ended = ending(&t2)[..2] == ["terminated", "done_by_runner"];
        ok_if(ended && released, format!("{t2} {marked:?}"))
    });
    eprintln!(
        "MEASURED exit on a full home -> terminated shown, key released: {:?}",
        exited.elapsed()
    );

    // The pull completes; the start goes on to `running`, which needs no write.
    proxy.open();
    wait_until("t4's image pulled", WAIT, || {
        docker_at(None, &["image", "inspect", &pulled])
            .status
            .success()
    });
    // Let the shim try (the retry pass runs every second): two more failed writes, counted.
    let failed = || {
        shim.metrics()
            .get("dstack_shim_state_write_errors_total", &[])
    };
    let before = failed();
    wait_for("two more failed state writes (retries)", WAIT, || {
        let now = failed();
        ok_if(now >= before + 2.0, format!("{before} -> {now}"))
    });
    // The pull's end, `creating`, the new container's id and `running` are start progress,
    // which needs no write of its own, and neither a create nor a start needs a record (the
    // container carries the task's labels, so a restart finds it): the container runs.
    let t4_cid = wait_for("t4's container runs", WAIT, || {
        match shim.containers().get(&container_name_of(&t4_config)) {
            Some((cid, true)) => Ok(cid.clone()),
            other => Err(format!("{other:?}")),
        }
    });
    // The API shows `running` as soon as the container runs (SPEC §5: the container proves
    // it, and a restart reads Docker first), while the record stays `pulling`.
    shim.wait_status("t4", "running");
    let t4_file = shim.task_dir("t4").join("task.json");
    let t4_record = || world::read_json(&t4_file);
    assert_eq!(
        t4_record()["rust_shim"]["status"],
        "pulling",
        "t4's `running` is not written on its own: {}",
        t4_record()
    );

    // Space returns: the terminations are written (within a second or two), no restart
    // needed; t4's record stays as it is.
    let unwritten = || shim.metrics().try_get("dstack_shim_unwritten_tasks", &[]);
    assert_eq!(unwritten(), Some(2.0), "t1's and t2's terminations");
    fs.free(&filler);
    let freed = Instant::now();
    let what = "t1's and t2's terminations land in their records";
    wait_for(what, WAIT, || {
        let now = unwritten();
        ok_if(now == Some(0.0), format!("{now:?} unwritten"))
    });
    eprintln!(
        "MEASURED space freed -> the terminations written: {:?}",
        freed.elapsed()
    );
    assert_eq!(t4_record()["rust_shim"]["status"], "pulling");
    assert_eq!(marked_keys(&user), BTreeSet::new());

    // Restart: the started task runs on in its container.
    shim.restart();
    assert_has!(shim.info("t4"), {"status": "running", "container_id": t4_cid});
    assert_eq!(shim.running(&t4_cid), Some(true));
    for id in ["t1", "t2", "t4"] {
        shim.terminate(id, "terminated_by_server", "", 0);
        shim.remove_retrying(id);
    }
    assert_nothing_left(&shim, Some(&user));
}

// 4. Unusable state files -------------------------------------------------------------------------

// SPEC §5, §7: state files that are garbage, truncated, of a future format version, or a
// directory, with their containers running. The shim starts; each task is restored from its
// container (running, same container) and can be terminated and removed; the bad file is
// moved aside as `task.json.corrupt-<ms>` (the directory too). The `authorized_keys` lines
// of those tasks, now of unknown origin, stay while any of them lives — even when another
// task of the same user is released — and go once the last of them is released; the user's
// own line is never touched. (Real key lines across a restart: not the fake world, whose keys
// are new fakes at each start.)
async fn unusable_state_files_are_moved_aside_and_their_tasks_keep_their_keys<W: world::World>() {
    let mut w = W::new(world::Options::with(|o| o.host_user = true)).await;
    let keys = w.host_user().unwrap();
    let own = ssh_key("own@faults");
    w.add_own_key_line(&own);
    let kinds = ["garbage", "truncated", "future", "directory"];
    let ids: Vec<&str> = kinds.iter().copied().chain(["healthy"]).collect();
    let mut configs = BTreeMap::new();
    for id in &ids {
        let config = with_host_keys(w.task(id, 0), &keys.user, &[&ssh_key(id)]);
        w.submit(&config).await.unwrap();
        configs.insert(*id, config);
    }
    let mut before = BTreeMap::new();
    for id in &ids {
        before.insert(*id, w.wait_status(id, "running").await);
    }
    let all_keys: BTreeSet<String> = ids.iter().map(|id| key_blob(&ssh_key(id))).collect();
    assert_eq!(keys.marked(), all_keys);

    w.stop().await;
    let runners = w.home().join("runners");
    let mut bad = BTreeMap::new();
    for kind in kinds {
        let file = runners
            .join(container_name_of(&configs[kind]))
            .join("task.json");
        let good = fs_err::read(&file).unwrap();
        let content: Option<Vec<u8>> = match kind {
            "garbage" => Some(b"\0\x01 this is not JSON {".to_vec()),
            "truncated" => Some(good[..good.len() / 2].to_vec()),
            "future" => {
                let mut json: Value = serde_json::from_slice(&good).unwrap();
                assert_eq!(json["version"], 1, "{json}");
                json["version"] = json!(2);
                Some(serde_json::to_vec(&json).unwrap())
            }
            _ => None,
        };
        match &content {
            Some(bytes) => fs_err::write(&file, bytes).unwrap(),
            None => {
                fs_err::remove_file(&file).unwrap();
                fs_err::create_dir(&file).unwrap();
                fs_err::write(file.join("inside"), "x").unwrap();
            }
        }
        bad.insert(kind, content);
    }
    w.start().await;

    for kind in kinds {
        let info = w.info(kind).await.unwrap();
        let cid = &before[kind]["container_id"];
        assert_has!(info, {"status": "running", "container_id": cid}, "{kind}:");
        let task_dir = runners.join(container_name_of(&configs[kind]));
        let aside: Vec<String> = entries(&task_dir)
            .into_iter()
            .filter(|n| n.starts_with("task.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{kind}: {:?}", entries(&task_dir));
        let aside = task_dir.join(&aside[0]);
        match &bad[kind] {
            Some(bytes) => assert_eq!(&fs_err::read(&aside).unwrap(), bytes, "{kind}"),
            None => assert_eq!(
                fs_err::read_to_string(aside.join("inside")).unwrap(),
                "x",
                "{kind}: the directory is moved aside as it was"
            ),
        }
    }
    assert_eq!(w.info("healthy").await.unwrap()["status"], "running");
    assert_eq!(keys.marked(), all_keys, "no key line lost at the restart");

    // Released one by one: the unknown-origin lines stay while any restored task lives, also
    // when the healthy task (same user, known keys) is released.
    let healthy = key_blob(&ssh_key("healthy"));
    let mut unknown = all_keys.clone();
    unknown.remove(&healthy);
    for id in ["garbage", "truncated", "healthy", "future"] {
        w.finish(id).await;
        let marked = keys.marked();
        assert!(
            unknown.is_subset(&marked),
            "after releasing {id}: lines of unknown origin went while a task with unknown keys \
             lives: {marked:?}"
        );
        let released_healthy = ["healthy", "future"].contains(&id);
        assert_eq!(
            marked.contains(&healthy),
            !released_healthy,
            "after releasing {id}: the healthy task's line: {marked:?}"
        );
    }
    w.finish("directory").await;
    assert_eq!(
        keys.marked(),
        BTreeSet::new(),
        "the lines of unknown origin go once the last task with unknown keys is released"
    );
    assert_eq!(keys.lines(), vec![own]);
    assert_eq!(w.containers().await, 0);
    assert_eq!(task_entries(&runners), BTreeSet::new());
}
in_worlds!(unusable_state_files_are_moved_aside_and_their_tasks_keep_their_keys: docker, binary);

// A state file that could not be read at a start (an I/O error: a bad sector, a full file
// table) is not garbage. Its task's container running, the task is restored from the
// container and the file's bytes are kept aside (`task.json.corrupt-<ms>`), not replaced by
// the record written for the restored task; with no container, the file stays in place and
// the task is back at the next start that reads it. Such a file used to be moved aside like
// garbage, and a task without a container was forgotten for good (its volumes, its keys).
async fn a_state_file_that_cannot_be_read_at_a_start_is_kept<W: world::World>() {
    let mut w = W::new(world::Options::with(|o| o.fillable_home = true)).await;
    let runners = w.home().join("runners");
    let t1 = w.submitted("t1", 0, "running").await;
    let dir = runners.join(container_name_of(&w.task("t1", 0)));
    let bytes = fs_err::read(dir.join("task.json")).unwrap();
    w.fail_next_state_read().await;
    w.restart().await;
    let info = w.wait_status("t1", "running").await;
    assert_eq!(info["container_id"], t1["container_id"]);
    let aside: Vec<String> = (entries(&dir).into_iter())
        .filter(|n| n.starts_with("task.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "{:?}", entries(&dir));
    assert_eq!(
        fs_err::read(dir.join(&aside[0])).unwrap(),
        bytes,
        "kept as it was"
    );
    w.finish("t1").await;

    let t2 = w.submitted("t2", 0, "running").await;
    w.stop().await;
    w.remove_container(cid(&t2)).await;
    w.fail_next_state_read().await;
    w.start().await;
    assert!(
        w.info("t2").await.is_none(),
        "not restored: no record read, no container"
    );
    let dir = runners.join(container_name_of(&w.task("t2", 0)));
    assert!(dir.join("task.json").exists(), "left in place");
    // Read at this start: known again, from its record alone (it has no container).
    w.restart().await;
    w.wait_status("t2", "terminated").await;
    w.remove("t2").await;
}
in_worlds!(a_state_file_that_cannot_be_read_at_a_start_is_kept: fake, docker);

// 5. Lost answers ---------------------------------------------------------------------------------

// A create and a start whose answers never reach the shim (the requests are carried out, the
// answer is lost, as a request timeout on a loaded daemon would look) do not fail the task:
// the shim looks at the container, takes the one made under the task's name and labels, finds
// it started, and the task runs in it. Upstream does not bound these requests
// (runner/internal/shim/docker.go creates and starts with the task's `context.Background()`);
// this shim bounds each at 30 s, so a slow answer must not become a failed task. A remove
// whose container removal answer is lost fails with the cause and keeps the task; the next
// remove (the server retries) finds the container gone and completes, leaving nothing behind.
async fn lost_engine_answers_neither_fail_the_task_nor_leak_it<W: world::World>() {
    let w = W::new(world::Options::with(|o| o.losing_engine = true)).await;
    let info = w.submitted("lost", 1, "running").await;
    assert_eq!(w.answers_lost(), 2, "the create's and the start's");
    let cid = info["container_id"].as_str().unwrap();
    assert_eq!(w.container_running(cid).await, Some(true));
    assert_eq!(w.containers().await, 1, "one container, made once");

    let done = w.terminate("lost", "terminated_by_server", "", 0).await;
    assert_eq!(done["status"], "terminated", "{done}");
    let refused = w.try_remove("lost").await.unwrap_err();
    let cause = "container runtime unavailable";
    assert!(
        refused.starts_with("500 ") && refused.contains(cause),
        "{refused}"
    );
    assert_eq!(w.answers_lost(), 3, "and the removal's");
    assert_eq!(w.info("lost").await.unwrap()["status"], "terminated");
    w.remove("lost").await;
    assert!(w.info("lost").await.is_none());
    assert_eq!(w.containers().await, 0);
    assert_eq!(task_entries(&w.home().join("runners")), BTreeSet::new());
}
in_worlds!(lost_engine_answers_neither_fail_the_task_nor_leak_it: fake, docker, binary);

// A start whose answer never comes while the container runs does not hold the task for the
// request's 30 s bound: the shim looks at the container 5 s in, finds it running and goes on
// (the held request is dropped). Seen in the throughput bench on Docker 28.5 (containerd
// store): three starts in about 150,000 went unanswered for the whole 30 s, the container running
// all along. Upstream waits for the answer without a bound (runner/internal/shim/docker.go
// starts with the task's `context.Background()`).
async fn a_start_whose_answer_never_comes_runs_in_seconds<W: world::World>() {
    let w = W::new(world::Options::with(|o| o.late_engine = true)).await;
    let asked = tokio::time::Instant::now();
    let info = w.submitted("late", 1, "running").await;
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "running {took:?} after the submit: the start's bound was waited out"
    );
    assert_eq!(w.answers_lost(), 1, "the start's");
    let cid = info["container_id"].as_str().unwrap();
    assert_eq!(w.container_running(cid).await, Some(true));
    assert_eq!(w.containers().await, 1, "one container, started once");
    w.finish("late").await;
    assert_eq!(w.containers().await, 0);
}
in_worlds!(a_start_whose_answer_never_comes_runs_in_seconds: fake, docker, binary);

// SPEC §5: the engine away for a while (its socket refuses every connection, the event stream
// cut) changes no task: a runner that exits meanwhile is not judged, a relist fails and
// changes nothing; once the engine is back, the exit is found and judged as its event would
// have been (`done_by_runner`).
async fn an_engine_away_for_a_while_changes_nothing<W: world::World>() {
    let w = W::new(world::Options::with(|o| o.flaky_engine = true)).await;
    let info = w.submitted("flaky", 0, "running").await;
    let cid = info["container_id"].as_str().unwrap();

    w.set_engine_reachable(false).await;
    w.exit_runner(&info, 0).await;
    w.wait_stopped(cid).await;
    for _ in 0..3 {
        if let Some(listed) = w.relist().await {
            assert!(!listed, "the list must fail while the engine is away");
        }
        w.sleep(Duration::from_millis(300)).await;
    }
    let now = w.info("flaky").await.unwrap();
    assert_has!(now, {"status": "running"}, "no task changes while the engine is away:");

    w.set_engine_reachable(true).await;
    let done = w.wait_status("flaky", "terminated").await;
    assert_has!(done, {"termination_reason": "done_by_runner"});
    w.remove("flaky").await;
}
in_worlds!(an_engine_away_for_a_while_changes_nothing: fake, docker, binary);

// SPEC §4–§5 (issue 22: a failed state write never blocks a stop or a release; issue 28: a
// container that no longer runs is terminated at once): a home whose disk fills up under
// running tasks. While full: a submit fails with the cause (ENOSPC) and leaves nothing; a
// terminate answers `terminated` with its reason and stops the container although the record
// cannot be written (the failed writes counted, the unwritten task shown); a runner's exit is
// reported at once; the server's terminate then remove of a task is accepted and leaves
// nothing. Once space returns, without a restart: the failed terminate's reason lands in the state file and a
// second terminate keeps it, the exit is recorded, no task is left unwritten; after a restart
// every answered end stays.
async fn a_full_home_fails_writes_with_their_cause_and_converges_when_freed<W: world::World>() {
    let mut w = W::new(world::Options::with(|o| o.fillable_home = true)).await;
    let [t1, t2, t5] = w.all_running([("t1", 1), ("t2", 1), ("t5", 1)]).await;
    // t2's exit, ready to be renamed into place (a rename needs no free block).
    shim_e2e::harness::stage_runner_exit(&w.home(), &t2, 0).unwrap();
    let failed_writes = async || {
        let metrics = w.metrics().await;
        metrics.get("dstack_shim_state_write_errors_total", &[])
    };
    let failed_before = failed_writes().await;
    let unwritten = async || {
        let metrics = w.metrics().await;
        metrics.get("dstack_shim_unwritten_tasks", &[])
    };
    w.set_disk_full(true).await;

    let t3 = w.task("t3", 0);
    let refused = w.submit(&t3).await.unwrap_err();
    assert!(
        refused.starts_with("500") && refused.contains(ENOSPC),
        "the cause: {refused}"
    );
    assert!(w.info("t3").await.is_none());
    let t3_dir = w.home().join("runners").join(container_name_of(&t3));
    assert!(!t3_dir.exists(), "a failed submit left its directory");
    // What the failed submit made and removed gave blocks back: fill them.
    w.set_disk_full(true).await;

    let first = w.terminate("t1", "terminated_by_user", "first", 0).await;
    let t1_end = ["terminated", "terminated_by_user", "first"];
    assert_eq!(ending(&first)[..3], t1_end, "what was done: {first}");
    assert_eq!(ending(&w.info("t1").await.unwrap()), ending(&first));
    assert_eq!(w.container_running(cid(&t1)).await, Some(false));
    let t1_file = w.state_file(&t1).unwrap();
    assert_has!(t1_file, {"termination_reason": ""}, "not durable yet:");
    assert!(
        failed_writes().await > failed_before,
        "the failed writes are counted"
    );
    assert!(unwritten().await >= 1.0, "t1's record waits for the disk");

    w.exit_runner(&t2, 0).await;
    let t2_end = w.wait_status("t2", "terminated").await;
    assert_has!(t2_end, {"termination_reason": "done_by_runner"});

    w.terminate("t5", "terminated_by_server", "", 0).await;
    w.try_remove("t5").await.unwrap();
    assert!(w.info("t5").await.is_none());
    assert_eq!(w.container_running(cid(&t5)).await, None);
    let t5_dir = w.home().join("runners").join(container_name_of(&t5));
    assert!(!t5_dir.exists(), "t5's directory is gone");

    w.set_disk_full(false).await;
    w.wait_state_file(&t1, "records t1's termination", |f| {
        f["termination_reason"] == "terminated_by_user" && f["cleaned_up"] == true
    })
    .await;
    let second = w.terminate("t1", "terminated_by_server", "second", 0).await;
    assert_eq!(ending(&second), ending(&first), "the first reason stays");
    w.wait_state_file(&t2, "records t2's exit", |f| {
        f["termination_reason"] == "done_by_runner"
    })
    .await;
    let written = async || unwritten().await == 0.0;
    w.wait_until("every record written once space returned", written)
        .await;

    w.restart().await;
    assert_eq!(ending(&w.info("t1").await.unwrap()), ending(&first));
    assert_eq!(
        ending(&w.info("t2").await.unwrap())[..2],
        ["terminated", "done_by_runner"]
    );
    assert!(w.info("t3").await.is_none());
    for id in ["t1", "t2"] {
        w.remove(id).await;
    }
    assert!(w.list().await.is_empty());
    assert_eq!(w.containers().await, 0);
}
in_worlds!(a_full_home_fails_writes_with_their_cause_and_converges_when_freed: fake, docker, binary);

// A terminate that comes while its task's submit is still writing (a slow disk), a write that
// then fails (the disk full), is answered 404 like any later call on the task: the submit
// failed, so the task never was (the server saw its 500). It was answered 200 `terminated`
// for a task no list, info or remove knew. The binary world cannot hold a write.
// upstream: runner/internal/shim/api/handlers.go (TaskTerminateHandler: an unknown task, 404).
async fn a_terminate_racing_a_failing_submit_finds_no_task<W: world::World>() {
    let w = W::new(world::Options::with(|o| o.fillable_home = true)).await;
    let t1 = w.task("t1", 0);
    w.set_disk_full(true).await;
    w.hold_writes(true, 0).await;
    let racing = async {
        w.hold_writes(true, 1).await;
        let terminate = w.try_terminate("t1", "terminated_by_user", "racing", 0);
        let release = async {
            // Lets the terminate reach the task, where the submit's write holds it up.
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            w.hold_writes(false, 0).await;
        };
        tokio::join!(terminate, release).0
    };
    let (submitted, terminated) = tokio::join!(w.submit(&t1), racing);
    let refused = submitted.unwrap_err();
    assert!(
        refused.starts_with("500") && refused.contains(ENOSPC),
        "{refused}"
    );
    let gone = terminated.unwrap_err();
    assert!(gone.starts_with("404"), "the terminate: {gone}");
    assert!(w.info("t1").await.is_none());
    let t1_dir = w.home().join("runners").join(container_name_of(&t1));
    assert!(!t1_dir.exists(), "a failed submit left its directory");

    // Nothing of it is left to stand in the way of the server's next submit.
    w.set_disk_full(false).await;
    w.submitted("t1", 0, "running").await;
    w.finish("t1").await;
    assert!(w.list().await.is_empty());
}
in_worlds!(a_terminate_racing_a_failing_submit_finds_no_task: fake, docker);
