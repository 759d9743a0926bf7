#!/usr/bin/env python3
"""A stand-in `systemctl` for machines without systemd as PID 1 (CI, containers), used by the
fleet test (tests/tests/fleet.rs) so that the dstack server's SSH provisioning can run the shim
as it does on a real host.

The test puts this script where the provisioning's `sudo systemctl ...` finds it (first on
sudo's secure_path, /usr/local/sbin, in the test sshd's own mount namespace), with a
`systemctl.json` beside it:

    {"script": "...", "unit_dir": "...", "state_dir": "...", "mount_ns": "/proc/<pid>/ns/mnt"}

`script` is this file's real path, `unit_dir` where the units are read from (the directory
mounted over /etc/systemd/system in that namespace, by its real path), `state_dir` where the
supervisors keep their pid files and the services' output (`<unit>.journal`), `mount_ns` the
mount namespace the services run in (the test's: a real service does not see the test sshd's
mounts).

It honours what the server's unit uses (upstream:
src/dstack/_internal/server/services/ssh_fleets/provisioning.py, run_shim_as_systemd_service):
`ExecStart`, `WorkingDirectory`, `EnvironmentFile` (systemd's quoting), `User=root` (HOME,
USER, LOGNAME, SHELL), `Restart=always` with `RestartSec`, `StartLimitIntervalSec` and
`StartLimitBurst`; and the commands the provisioning runs: `daemon-reload`, `enable`,
`restart`, `status`; plus `start`, `stop` and `is-active` for the test.
Like systemctl it prints nothing on success except for status, is-active and show (the server
fails a provisioning step that prints anything).

A service runs under a supervisor process (this script, `__supervise <unit>`, detached) that
starts `ExecStart`, waits for it, and restarts it after `RestartSec` unless it was stopped.
Each start is appended to `<unit>.starts` (`<pid> <unix time>`); the main pid is in
`<unit>.pid`, the supervisor's in `<unit>.supervisor`.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
CONFIG = json.load(open(os.path.join(HERE, "systemctl.json")))
SCRIPT = CONFIG["script"]
UNIT_DIR = CONFIG["unit_dir"]
STATE_DIR = CONFIG["state_dir"]
MOUNT_NS = CONFIG.get("mount_ns", "")
# systemd's default TimeoutStopSec.
STOP_TIMEOUT = 90
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def log(message):
    with open(os.path.join(STATE_DIR, "systemctl.log"), "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {message}\n")


def unit_name(name):
    return name if "." in name else name + ".service"


def state_path(unit, suffix):
    return os.path.join(STATE_DIR, f"{unit}.{suffix}")


def read_unit(unit):
    """The unit file as {section: {key: value}} (the last assignment of a key wins)."""
    sections = {}
    current = sections.setdefault("", {})
    with open(os.path.join(UNIT_DIR, unit)) as f:
        for raw in f:
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                current = sections.setdefault(line[1:-1], {})
                continue
            key, _, value = line.partition("=")
            current[key.strip()] = value.strip()
    return sections


def read_env_file(spec):
    """`EnvironmentFile=`: KEY=VALUE lines, values optionally quoted as systemd reads them;
    a leading `-` makes a missing file fine."""
    optional = spec.startswith("-")
    path = spec[1:] if optional else spec
    env = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        if optional:
            return env
        raise
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            out, i, inner = [], 0, value[1:-1]
            while i < len(inner):
                if inner[i] == "\\" and i + 1 < len(inner):
                    i += 1
                out.append(inner[i])
                i += 1
            value = "".join(out)
        elif len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def alive(pid):
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A zombie is not running.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def write_file(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def supervise(unit):
    """The supervisor: runs ExecStart, restarts it as the unit says, until stopped."""
    sections = read_unit(unit)
    service = sections.get("Service", {})
    unit_section = sections.get("Unit", {})
    argv = shlex.split(service["ExecStart"].lstrip("-@:+!"))
    restart = service.get("Restart", "no")
    restart_sec = float(service.get("RestartSec", "0.1").rstrip("s"))
    limit_interval = float(unit_section.get("StartLimitIntervalSec", "10").rstrip("s"))
    limit_burst = int(unit_section.get("StartLimitBurst", "5"))
    stopped = False
    child = None

    def on_term(signum, frame):
        nonlocal stopped
        stopped = True
        if child is not None and child.poll() is None:
            child.terminate()

    signal.signal(signal.SIGTERM, on_term)
    starts = []
    while not stopped:
        now = time.time()
        starts = [t for t in starts if now - t < limit_interval] + [now]
        if len(starts) > limit_burst:
            log(f"{unit}: start limit hit ({limit_burst} in {limit_interval}s): failed")
            write_file(state_path(unit, "failed"), "start-limit-hit\n")
            break
        env = {"PATH": PATH, "LANG": "C.UTF-8"}
        user = service.get("User", "root")
        if user == "root":
            env.update(HOME="/root", USER="root", LOGNAME="root", SHELL="/bin/sh")
        for spec in service.get("EnvironmentFile", "").split():
            env.update(read_env_file(spec))
        journal = open(state_path(unit, "journal"), "ab")
        child = subprocess.Popen(
            argv,
            cwd=service.get("WorkingDirectory") or "/",
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=journal,
            stderr=journal,
        )
        journal.close()
        if stopped:
            child.terminate()
        write_file(state_path(unit, "pid"), f"{child.pid}\n")
        with open(state_path(unit, "starts"), "a") as f:
            f.write(f"{child.pid} {now:.3f}\n")
        log(f"{unit}: started {argv} as {child.pid}")
        status = child.wait()
        log(f"{unit}: {child.pid} exited with {status}")
        if stopped or restart == "no":
            break
        if restart == "on-failure" and status == 0:
            break
        deadline = time.time() + restart_sec
        while not stopped and time.time() < deadline:
            time.sleep(0.05)
    for suffix in ("pid", "supervisor"):
        try:
            os.remove(state_path(unit, suffix))
        except FileNotFoundError:
            pass


def stop(unit):
    supervisor = read_pid(state_path(unit, "supervisor"))
    main = read_pid(state_path(unit, "pid"))
    if alive(supervisor):
        os.kill(supervisor, signal.SIGTERM)
    deadline = time.time() + STOP_TIMEOUT
    while (alive(supervisor) or alive(main)) and time.time() < deadline:
        time.sleep(0.05)
    for pid in (main, supervisor):
        if alive(pid):
            log(f"{unit}: {pid} did not stop in {STOP_TIMEOUT}s: SIGKILL")
            os.kill(pid, signal.SIGKILL)
    for suffix in ("pid", "supervisor"):
        try:
            os.remove(state_path(unit, suffix))
        except FileNotFoundError:
            pass


def start(unit):
    if alive(read_pid(state_path(unit, "supervisor"))):
        return
    read_unit(unit)  # a missing unit fails here, before anything starts
    try:
        os.remove(state_path(unit, "failed"))
    except FileNotFoundError:
        pass
    prefix = ["nsenter", f"--mount={MOUNT_NS}", "--"] if MOUNT_NS else []
    supervisor = subprocess.Popen(
        prefix + [sys.executable, SCRIPT, "__supervise", unit],
        stdin=subprocess.DEVNULL,
        stdout=open(os.path.join(STATE_DIR, "supervisor.out"), "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd="/",
    )
    write_file(state_path(unit, "supervisor"), f"{supervisor.pid}\n")
    # Type=simple: started once the main process was forked.
    deadline = time.time() + 30
    while read_pid(state_path(unit, "pid")) is None and time.time() < deadline:
        if supervisor.poll() is not None:
            raise SystemExit(f"Job for {unit} failed: the supervisor exited")
        time.sleep(0.02)


def status(unit):
    main = read_pid(state_path(unit, "pid"))
    supervisor = read_pid(state_path(unit, "supervisor"))
    if os.path.exists(state_path(unit, "failed")):
        active = "failed (Result: start-limit-hit)"
    elif alive(main):
        active = "active (running)"
    elif alive(supervisor):
        active = "activating (auto-restart)"
    else:
        active = "inactive (dead)"
    return active, main


def main(argv):
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        raise SystemExit("systemctl (stand-in): no command")
    command, units = words[0], [unit_name(u) for u in words[1:]]
    log(f"systemctl {' '.join(argv)}")
    if command == "__supervise":
        supervise(units[0])
    elif command == "daemon-reload":
        pass
    elif command in ("enable", "disable"):
        for unit in units:
            read_unit(unit)
            path = state_path(unit, "enabled")
            if command == "enable":
                write_file(path, "enabled\n")
            elif os.path.exists(path):
                os.remove(path)
    elif command == "start":
        for unit in units:
            start(unit)
    elif command == "stop":
        for unit in units:
            stop(unit)
    elif command == "restart":
        for unit in units:
            stop(unit)
            start(unit)
    elif command == "is-active":
        active = [status(u)[0].split()[0] for u in units]
        print("\n".join(active))
        return 0 if all(a == "active" for a in active) else 3
    elif command == "status":
        code = 0
        for unit in units:
            active, main_pid = status(unit)
            print(f"* {unit} - {read_unit(unit).get('Unit', {}).get('Description', unit)}")
            print(f"     Loaded: loaded ({os.path.join(UNIT_DIR, unit)})")
            print(f"     Active: {active}")
            if main_pid is not None:
                print(f"   Main PID: {main_pid}")
            if not active.startswith("active"):
                code = 3
        return code
    else:
        raise SystemExit(f"systemctl (stand-in): unknown command {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
