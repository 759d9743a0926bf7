#!/usr/bin/env python3
"""
The API lifecycle of one shim binary, driven by the dstack server's own code.

It starts the shim binary itself (optionally under a wrapper such as `qemu-aarch64-static`) on
a fresh home, and walks tasks through their lifecycle with what the server's pipelines call,
with the arguments they pass (dstack==0.22.5, PyPI `dstack[server]`):

* `ShimClient` (dstack/_internal/server/services/runner/client.py): negotiation, the version
  gates, `get_components`, `submit_task`, `get_task`, `list_tasks`, `terminate_task`,
  `remove_task`, `is_safe_to_restart`, `shutdown`;
* `_sync_shim_pulling_state` (pipeline_tasks/jobs_running.py: how the server polls a task it
  submitted until it runs, reads its ports, or learns why it failed), called through
  `__wrapped__` with the shim's port in place of the SSH tunnel, as check_shim.py does;
* `RunnerClient.healthcheck` through the runner port the shim published (the server's
  `_is_runner_available`);
* `remove_dangling_tasks_from_instance` (services/instances.py: the instance check's clean-up of
  tasks no job claims: terminate with timeout 0, then remove) for the final clean-up.

The submit arguments are `_process_provisioning_with_shim`'s for a job without runtime data
(host network, `gpu`/`cpu`/`memory`/`shm_size` None) and for one with (bridge network); the
job names are the server's (`<run>-<job>-<replica>`), the task ids UUIDs.

The first task pulls the registry image with its credentials for real: when the image's
registry is on loopback (the dev-env registry), the image is pulled as
`127.0.0.1:<port of a TCP relay of this script>/<repository>:<tag>`, a name no other process
uses, so no shared image is removed and the pull always happens; otherwise the image is untagged
first if present. The containers run the stub runner (`--runner`, testdata/runner/dstack-runner),
which exits with the code written to `<runner dir>/exit`.

Checks, in order (each prints `ok NAME` or `FAIL NAME: why`; a check whose prerequisite failed
fails as not run):

  api                API negotiation, version gates, components (the shim's version from its
                     own `--version`, equal to the healthcheck's), an empty task list
  submit             submit_task of a registry image with credentials (host network)
  start              pulling -> running, a real pull, ports [] in host mode, READY for the
                     server, the container SSH key reached the runner
  done               exit 0 -> terminated / done_by_runner (the job is done); a later terminate
                     keeps the reason
  failed             a bridge task: ports for the server, the runner answers through them; exit
                     3 -> terminated / container_exited_with_error with the log's last lines
                     (the job failed)
  terminate          remove of a running task is refused (409); terminate with a timeout ->
                     the given reason and message, the runner stopped by SIGTERM
  remove             remove of the terminated tasks: gone from the API, their containers and
                     directories removed
  restart            SIGTERM, start again on the same home while two tasks run: the shim was
                     safe to restart, exits 0, the running task's container is untouched
  exited-while-down  the task whose container exited while the shim was down reads terminated
                     (container_exited_with_error, its exit's log) in the first answer
  shutdown           POST /api/shutdown as the server's restart sends it: the shim exits, the
                     container keeps running, the next start has the task running
  cleanup            the server's dangling-task clean-up terminates and removes what is left;
                     no container of the test remains

The Docker daemon is the one at --docker-host (the shim's DOCKER_HOST; default $DOCKER_HOST,
else Docker's default socket), in any network namespace shared with this script: the daemon
pulls through the relay on this script's loopback, and the runner answers on the loopback port
the shim published (as a host's daemon, shim and SSH tunnel share theirs). The home and the
runner are bind-mounted by the daemon, so their paths are the daemon's too.

Exit status: 0 when every check passed, 1 when one failed, 2 on a usage or setup error. The last
line is `lifecycle: N passed, M failed`. Every container the run made is removed at the end
(through the shim; as a last resort `docker rm -f` through the Docker API at --docker-host).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import http.client
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

try:
    import dstack.version
    from dstack._internal.core.consts import DSTACK_SHIM_HTTP_PORT
    from dstack._internal.core.models.common import NetworkMode
    from dstack._internal.core.models.runs import (
        JobRuntimeData,
        JobStatus,
        JobTerminationReason,
    )
    from dstack._internal.server.background.pipeline_tasks import jobs_running
    from dstack._internal.server.models import InstanceModel, JobModel
    from dstack._internal.server.schemas.runner import ComponentStatus, TaskStatus
    from dstack._internal.server.services import instances as server_instances
    from dstack._internal.server.services.runner import client as runner_client
except ImportError as e:  # pragma: no cover - environment problem
    print(
        f"error: cannot import the dstack server package ({e}).\n"
        "Install it with: pip install 'dstack[server]==0.22.5' (cargo xtask dev-env does)",
        file=sys.stderr,
    )
    sys.exit(2)

ShimClient = runner_client.ShimClient

CHECKS = [
    "api",
    "submit",
    "start",
    "done",
    "failed",
    "terminate",
    "remove",
    "restart",
    "exited-while-down",
    "shutdown",
    "cleanup",
]

TASK_ID_LABEL = "ai.dstack.shim.task-id"
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
ORDER = ["pending", "preparing", "pulling", "creating", "running", "terminated"]
POLL = 0.1


class SetupError(Exception):
    """A usage or environment problem: exit 2."""


class CheckFailed(Exception):
    pass


def expect(ok: bool, why: str) -> None:
    if not ok:
        raise CheckFailed(why)


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------------------------
# Docker's API over plain HTTP (unix:// or tcp://), no SDK


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Docker:
    def __init__(self, host: str) -> None:
        self.host = host
        parsed = urllib.parse.urlsplit(host)
        if parsed.scheme == "unix":
            self._unix: Optional[str] = parsed.path or parsed.netloc
            self._tcp: Optional[tuple[str, int]] = None
        elif parsed.scheme in ("tcp", "http") and parsed.hostname:
            self._unix = None
            self._tcp = (parsed.hostname, parsed.port or 2375)
        else:
            raise SetupError(f"--docker-host {host!r}: expected unix:///PATH or tcp://HOST:PORT")

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._unix is not None:
            return _UnixConnection(self._unix, timeout)
        assert self._tcp is not None
        return http.client.HTTPConnection(self._tcp[0], self._tcp[1], timeout=timeout)

    def request(
        self, method: str, path: str, query: Optional[dict[str, str]] = None, timeout: float = 60
    ) -> tuple[int, bytes]:
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        conn = self._connection(timeout)
        try:
            conn.request(method, path, headers={"Host": "docker"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def ping(self) -> None:
        try:
            status, body = self.request("GET", "/_ping", timeout=10)
        except OSError as e:
            raise SetupError(f"the Docker daemon at {self.host} does not answer: {e}") from e
        if status != 200:
            raise SetupError(f"the Docker daemon at {self.host}: /_ping answered {status} {body!r}")

    def inspect_container(self, ref: str) -> Optional[dict[str, Any]]:
        status, body = self.request("GET", f"/containers/{urllib.parse.quote(ref)}/json")
        if status == 404:
            return None
        if status != 200:
            raise CheckFailed(f"docker inspect {ref}: {status} {body[:200]!r}")
        return json.loads(body)

    def containers_of(self, task_ids: list[str]) -> list[dict[str, Any]]:
        """Every container (running or not) labelled with one of these task ids."""
        found = []
        for task_id in task_ids:
            filters = json.dumps({"label": [f"{TASK_ID_LABEL}={task_id}"]})
            status, body = self.request(
                "GET", "/containers/json", {"all": "1", "filters": filters}
            )
            if status != 200:
                raise CheckFailed(f"docker ps: {status} {body[:200]!r}")
            found.extend(json.loads(body))
        return found

    def remove_container(self, ref: str) -> int:
        status, _ = self.request(
            "DELETE", f"/containers/{urllib.parse.quote(ref)}", {"force": "1", "v": "1"}
        )
        return status

    def image_present(self, ref: str) -> bool:
        status, _ = self.request("GET", f"/images/{urllib.parse.quote(ref, safe='')}/json")
        return status == 200

    def remove_image(self, ref: str) -> int:
        """Untags `ref` (removes the image if it was its last name and no container uses it)."""
        status, _ = self.request(
            "DELETE", f"/images/{urllib.parse.quote(ref, safe='')}", {"noprune": "1"}
        )
        return status


# ---------------------------------------------------------------------------------------------
# A TCP relay to the registry, so the image has a name of this run's own


class Relay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=30)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()


def split_image(image: str) -> tuple[Optional[str], str]:
    """(registry host[:port] or None for Docker Hub, the rest)."""
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest
    return None, image


def loopback_registry(registry: Optional[str]) -> Optional[tuple[str, int]]:
    if registry is None:
        return None
    host, _, port = registry.rpartition(":")
    if not host or not port.isdigit():
        host, port = registry, "443"
    if host == "localhost" or host.startswith("127."):
        return ("127.0.0.1" if host == "localhost" else host, int(port))
    return None


# ---------------------------------------------------------------------------------------------
# The shim process


def _die_with_parent() -> None:
    """In the child before exec: the shim (or its wrapper) is killed if this script dies
    without cleaning up (its containers are then the caller's to sweep)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Shim:
    command: list[str]
    home: Path
    logs: Path
    docker_host: str
    runner: Path
    runner_http_port: int
    runner_ssh_port: int
    start_timeout: float
    process: Optional[subprocess.Popen] = None
    port: int = 0
    starts: int = 0

    def argv(self) -> list[str]:
        return self.command + [
            "--shim-home", str(self.home),
            "--shim-http-port", str(self.port),
            "--runner-binary-path", str(self.runner),
            "--runner-http-port", str(self.runner_http_port),
            "--runner-ssh-port", str(self.runner_ssh_port),
            "--volumes-root", str(self.logs / "volumes"),
            "--shim-log-level", "5",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # The shim reads DSTACK_* (and PJRT_DEVICE) when a flag is not given: none of the
        # caller's leak in. QEMU_LD_PREFIX and the like go through.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DSTACK_") and k not in ("PJRT_DEVICE", "RUST_LOG")
        }
        env["DOCKER_HOST"] = self.docker_host
        env["NO_COLOR"] = "1"
        return env

    def log_path(self) -> Path:
        return self.logs / f"shim-{self.starts}.log"

    def start(self) -> None:
        assert self.process is None, "the shim is already running"
        self.starts += 1
        self.port = free_port()
        log = open(self.log_path(), "ab")
        try:
            self.process = subprocess.Popen(
                self.argv(),
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            raise CheckFailed(f"cannot start {shlex.join(self.argv())}: {e}") from e
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if ShimClient.from_address(self.port).healthcheck() is not None:
                return
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise CheckFailed(
                    f"the shim exited with {code} before answering; end of its log:\n"
                    + self.tail()
                )
            if time.monotonic() > deadline:
                raise CheckFailed(
                    f"the shim did not answer within {self.start_timeout:.0f} s; end of its "
                    "log:\n" + self.tail()
                )
            time.sleep(0.05)

    def client(self) -> ShimClient:
        """A client as the server makes one for each request batch (through the tunnel)."""
        return ShimClient.from_address(self.port)

    def addresses(self) -> dict[int, int]:
        """What `@runner_ssh_tunnel` hands to the function it wraps."""
        return {DSTACK_SHIM_HTTP_PORT: self.port}

    def wait_exit(self, timeout: float) -> int:
        assert self.process is not None
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise CheckFailed(
                f"the shim did not exit within {timeout:.0f} s; end of its log:\n" + self.tail()
            ) from e
        self.process = None
        return code

    def sigterm(self, timeout: float) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        self.process = None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path().read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        text = [line for line in text if "request method=GET" not in line]
        return "\n".join("    | " + line for line in text[-lines:])


# ---------------------------------------------------------------------------------------------
# Task events (this shim's GET /api/events; optional)


class Events:
    """Collects `status` changes from GET /api/events, if the shim has it."""

    def __init__(self, port: int) -> None:
        self.statuses: dict[str, list[str]] = {}
        self.supported: Optional[bool] = None
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        try:
            self._conn.request("GET", "/api/events")
            resp = self._conn.getresponse()
            self.supported = resp.status == 200
            self._ready.set()
            if not self.supported:
                return
            event, data = None, []
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "":
                    if event == "change" and data:
                        change = json.loads("\n".join(data))
                        if change.get("change") == "status":
                            self.statuses.setdefault(change["task"], []).append(change["status"])
                        elif change.get("change") == "terminated":
                            self.statuses.setdefault(change["task"], []).append("terminated")
                    event, data = None, []
        except (OSError, http.client.HTTPException, ValueError):
            pass
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                self._conn.close()

    def close(self) -> None:
        """Ends the stream (the reader sees the connection closed) and waits for the reader."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)


def monotone(statuses: list[str]) -> bool:
    ranks = [ORDER.index(s) if s in ORDER else -1 for s in statuses]
    return -1 not in ranks and ranks == sorted(ranks)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Task:
    id: uuid.UUID
    name: str
    network_mode: NetworkMode
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def sid(self) -> str:
        return str(self.id)

    def job_model(self) -> JobModel:
        # Transient ORM object, never added to a session: what `_sync_shim_pulling_state` reads.
        return JobModel(id=self.id, job_name=self.name)


class Run:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.docker = Docker(args.docker_host)
        self.shim = Shim(
            command=args.prefix + [str(args.shim)],
            home=work / "home",
            logs=work,
            docker_host=args.docker_host,
            runner=args.runner,
            runner_http_port=free_port(),
            runner_ssh_port=free_port(),
            start_timeout=args.start_timeout,
        )
        self.shim.home.mkdir(parents=True, exist_ok=True)
        self.run_name = f"lifecycle-{uuid.uuid4().hex[:8]}"
        self.tasks: dict[str, Task] = {}
        self.relay: Optional[Relay] = None
        self.image = args.image
        self.key = container_ssh_key()
        self.events: Optional[Events] = None
        self.start_failed = False
        self.results: dict[str, Optional[str]] = {}
        self.timings: dict[str, float] = {}

    # -- helpers --------------------------------------------------------------------------

    def new_task(self, label: str, network_mode: NetworkMode) -> Task:
        n = len(self.tasks)
        task = Task(uuid.uuid4(), f"{self.run_name}-0-{n}", network_mode)
        self.tasks[label] = task
        return task

    def submit(self, task: Task) -> None:
        """`_process_provisioning_with_shim`'s call, for a job without runtime data (host
        network) or with (its network mode)."""
        self.shim.client().submit_task(
            task_id=task.id,
            name=task.name,
            registry_username=self.args.registry_username,
            registry_password=self.args.registry_password,
            image_name=self.image,
            container_user="root",
            privileged=False,
            gpu=None,
            cpu=None,
            memory=None,
            shm_size=None,
            network_mode=task.network_mode,
            volumes=[],
            volume_mounts=[],
            instance_mounts=[],
            gpu_devices=[],
            host_ssh_user="",
            host_ssh_keys=[],
            container_ssh_keys=[self.key],
            instance_id="lifecycle-instance",
        )

    def raw(self, task: Task) -> dict[str, Any]:
        """The shim's whole TaskInfo (container name and id, which the server's schema
        drops)."""
        resp = self.shim.client()._request("GET", f"/api/tasks/{task.sid}", raise_for_status=True)
        task.raw = resp.json()
        return task.raw

    def wait_status(
        self, task: Task, status: TaskStatus, timeout: float, seen: Optional[list[str]] = None
    ):
        """Polls `get_task` until `status`; a task that ends while another status is awaited
        fails at once."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.shim.client().get_task(task.id)
            if seen is not None and (not seen or seen[-1] != info.status.value):
                seen.append(info.status.value)
            if info.status == status:
                return info
            if info.status == TaskStatus.TERMINATED:
                raise CheckFailed(
                    f"task {task.name} ended while awaiting {status.value}: "
                    f"{info.termination_reason}: {info.termination_message!r}"
                )
            if time.monotonic() > deadline:
                raise CheckFailed(
                    f"task {task.name} still {info.status.value} after {timeout:.0f} s "
                    f"(awaiting {status.value})"
                )
            time.sleep(POLL)

    def runner_dir(self, task: Task) -> Path:
        name = task.raw.get("container_name") or self.raw(task)["container_name"]
        return self.shim.home / "runners" / name / "runner"

    def exit_runner(self, task: Task, code: int) -> None:
        runner = self.runner_dir(task)
        tmp = runner / ".exit.tmp"
        tmp.write_text(f"{code}\n")
        tmp.rename(runner / "exit")

    def container(self, task: Task) -> dict[str, Any]:
        cid = task.raw.get("container_id") or self.raw(task).get("container_id")
        expect(bool(cid), f"task {task.name} has no container id: {task.raw}")
        found = self.docker.inspect_container(cid)
        expect(found is not None, f"the container {cid[:12]} of {task.name} does not exist")
        return found

    def wait_container_stopped(self, task: Task, timeout: float) -> dict[str, Any]:
        # Until the engine has recorded the exit: Podman 4.3 shows a container whose process
        # ended as `stopped` (not running, exit code 0, no finish time) until its clean-up
        # process has run, and the shim reads that as still running (its code is unknown).
        deadline = time.monotonic() + timeout
        while True:
            found = self.container(task)
            if found["State"]["Status"] in ("exited", "dead"):
                return found
            if time.monotonic() > deadline:
                raise CheckFailed(f"the container of {task.name} still runs after {timeout} s")
            time.sleep(POLL)

    def pulling_state(self, task: Task, jrd: Optional[JobRuntimeData] = None):
        return jobs_running._sync_shim_pulling_state.__wrapped__(
            self.shim.addresses(), job_model=task.job_model(), jrd=jrd
        )

    def expect_terminated(self, task: Task, reason: str, message_has: Optional[str]) -> Any:
        info = self.shim.client().get_task(task.id)
        expect(
            info.status == TaskStatus.TERMINATED,
            f"task {task.name} is {info.status.value}, not terminated",
        )
        expect(
            info.termination_reason == reason,
            f"termination_reason {info.termination_reason!r} (message "
            f"{info.termination_message!r}), expected {reason!r}",
        )
        if message_has is None:
            expect(
                info.termination_message == "",
                f"termination_message {info.termination_message!r}, expected empty",
            )
        else:
            expect(
                message_has in info.termination_message,
                f"termination_message {info.termination_message!r} lacks {message_has!r}",
            )
        return info

    def expect_not_found(self, task: Task) -> None:
        try:
            info = self.shim.client().get_task(task.id)
        except runner_client.ShimResponseStatusError as e:
            expect(e.status_code == 404, f"get_task({task.name}): {e}")
            return
        raise CheckFailed(f"get_task({task.name}) still answers: {info.status.value}")

    # -- checks ---------------------------------------------------------------------------

    def check_api(self) -> None:
        try:
            self.shim.start()
        except CheckFailed:
            self.start_failed = True
            raise
        client = self.shim.client()
        hc = client.healthcheck(unmask_exceptions=True)
        check = runner_client.healthcheck_response_to_instance_check(hc)
        expect(check.reachable, f"instance check: not reachable: {hc!r}")
        expect(client.is_api_v2_supported(), f"API v1 negotiated for {hc.version!r}")
        for gate in ("is_instance_health_supported", "is_instance_info_supported",
                     "are_components_supported", "is_shutdown_supported"):  # fmt: skip
            expect(getattr(client, gate)(), f"{gate}() is False for {hc.version!r}")
        expect(
            TaskStatus.RUNNING in client._get_restart_safe_task_statuses(),
            f"running tasks are not restart-safe for {hc.version!r}",
        )
        components = client.get_components()
        expect(components is not None, "get_components() returned None")
        shim = components.shim
        expect(shim is not None, "no dstack-shim component")
        expect(
            shim.status == ComponentStatus.INSTALLED,
            f"dstack-shim component is {shim.status.value} (read from `<binary> --version`)",
        )
        expect(
            shim.version == client.get_version_string(),
            f"dstack-shim component version {shim.version!r} != the healthcheck's "
            f"{client.get_version_string()!r}: the server would restart the shim",
        )
        runner = components.runner
        expect(
            runner is not None and runner.status == ComponentStatus.INSTALLED,
            f"dstack-runner component: {runner!r}",
        )
        tasks = client.list_tasks().tasks
        expect(tasks == [], f"a fresh home lists tasks: {tasks}")
        say(f"  shim {hc.version} (API v2), runner {runner.version}")

    def check_submit(self) -> None:
        registry, rest = split_image(self.args.image)
        target = loopback_registry(registry)
        if target is not None and not self.args.no_relay:
            self.relay = Relay(target)
            self.image = f"127.0.0.1:{self.relay.port}/{rest}"
        elif self.docker.image_present(self.image):
            status = self.docker.remove_image(self.image)
            expect(status == 200, f"cannot untag {self.image} to pull it ({status})")
        expect(
            not self.docker.image_present(self.image),
            f"{self.image} is present: the pull would be skipped",
        )
        say(f"  image {self.image} (from {self.args.image}), with credentials")
        task = self.new_task("first", NetworkMode.HOST)
        self.events = Events(self.shim.port)
        self.submit(task)
        info = self.shim.client().get_task(task.id)
        expect(info.id == task.sid, f"get_task answered {info.id}")
        expect(info.status != TaskStatus.TERMINATED, f"terminated at once: {info}")
        listed = {t.id for t in self.shim.client().list_tasks().tasks}
        expect(task.sid in listed, f"list_tasks() lacks it: {listed}")

    def check_start(self) -> None:
        task = self.tasks["first"]
        polled: list[str] = []
        try:
            info = self.wait_status(task, TaskStatus.RUNNING, self.args.pull_timeout, polled)
        finally:
            time.sleep(0.2)
            self.events.close()
        streamed = self.events.statuses.get(task.sid, [])
        say(f"  statuses polled: {' -> '.join(polled)}; "
            + (f"streamed: {' -> '.join(streamed)}" if self.events.supported
               else "no /api/events"))  # fmt: skip
        expect(monotone(polled), f"polled statuses go backwards: {polled}")
        if self.events.supported:
            expect(monotone(streamed), f"streamed statuses go backwards: {streamed}")
            expect(
                "pulling" in streamed and streamed[-1] == "running",
                f"expected pulling ... running, streamed {streamed}",
            )
        expect(
            info.image_pull_progress is not None,
            "image_pull_progress is null: the image was not pulled",
        )
        expect(info.ports == [], f"host network: ports {info.ports}, expected []")
        state = self.pulling_state(task)
        expect(
            state.state == jobs_running._ShimPullingState.READY,
            f"_sync_shim_pulling_state: {state}",
        )
        container = self.container(task)
        expect(container["State"]["Running"], f"container not running: {container['State']}")
        expect(
            container["Config"]["Labels"].get(TASK_ID_LABEL) == task.sid,
            f"container labels {container['Config']['Labels']}",
        )
        args_file = self.runner_dir(task) / "stub-runner.args"
        deadline = time.monotonic() + self.args.timeout
        while not args_file.exists() and time.monotonic() < deadline:
            time.sleep(POLL)
        runner_args = args_file.read_text().splitlines() if args_file.exists() else []
        expect(
            self.key in runner_args and str(self.shim.runner_http_port) in runner_args,
            f"the runner's arguments lack the container key or the http port: {runner_args}",
        )

    def check_done(self) -> None:
        task = self.tasks["first"]
        self.exit_runner(task, 0)
        self.wait_status(task, TaskStatus.TERMINATED, self.args.timeout)
        info = self.expect_terminated(task, "done_by_runner", None)
        reason = JobTerminationReason(info.termination_reason.lower())
        expect(reason.to_status() == JobStatus.DONE, f"{reason} is {reason.to_status()}")
        state = self.wait_container_stopped(task, self.args.timeout)["State"]
        expect(state["ExitCode"] == 0, f"container exit code {state['ExitCode']}")
        # The server always terminates (`_shim_submit_stop`: timeout 0): the first reason stays.
        self.shim.client().terminate_task(
            task_id=task.id, reason="terminated_by_server", message="late", timeout=0
        )
        self.expect_terminated(task, "done_by_runner", None)

    def runner_ready(self, task: Task) -> dict[int, int]:
        """For a running bridge task, what the server does before it submits the job: reads
        the published ports (`_sync_shim_pulling_state` with runtime data) and waits until the
        runner answers through them (`_is_runner_available`). The ports, container -> host."""
        jrd = JobRuntimeData(network_mode=NetworkMode.BRIDGE)
        state = self.pulling_state(task, jrd)
        expect(
            state.state == jobs_running._ShimPullingState.READY,
            f"_sync_shim_pulling_state: {state}",
        )
        ports = state.job_runtime_data.ports
        wanted = {self.shim.runner_http_port, self.shim.runner_ssh_port}
        expect(ports is not None and set(ports) == wanted, f"ports {ports}, expected {wanted}")
        runner = runner_client.RunnerClient(port=ports[self.shim.runner_http_port])
        deadline = time.monotonic() + self.args.timeout
        while (hc := runner.healthcheck()) is None and time.monotonic() < deadline:
            time.sleep(POLL)
        expect(hc is not None, "the runner does not answer through its published port")
        return ports

    def check_failed(self) -> None:
        task = self.new_task("failed", NetworkMode.BRIDGE)
        self.submit(task)
        self.wait_status(task, TaskStatus.RUNNING, self.args.timeout)
        self.runner_ready(task)
        self.exit_runner(task, 3)
        self.wait_status(task, TaskStatus.TERMINATED, self.args.timeout)
        info = self.expect_terminated(task, "container_exited_with_error", "runner exiting with 3")
        state = self.pulling_state(task, JobRuntimeData(network_mode=NetworkMode.BRIDGE))
        expect(
            state.state == jobs_running._ShimPullingState.FAILED
            and state.termination_reason == JobTerminationReason.CONTAINER_EXITED_WITH_ERROR
            and state.termination_reason.to_status() == JobStatus.FAILED,
            f"_sync_shim_pulling_state: {state}",
        )
        last = info.termination_message.splitlines()[-1:]
        say(f"  failed with {info.termination_reason}, message ending {last}")

    def check_terminate(self) -> None:
        task = self.new_task("terminated", NetworkMode.BRIDGE)
        self.submit(task)
        self.wait_status(task, TaskStatus.RUNNING, self.args.timeout)
        # The runner answers, and has set its SIGTERM trap a moment later (a signal before
        # that is ignored: it is the container's PID 1).
        self.runner_ready(task)
        time.sleep(0.5)
        try:
            self.shim.client().remove_task(task.id)
            raise CheckFailed("remove of a running task answered 200")
        except runner_client.ShimResponseStatusError as e:
            expect(e.status_code == 409, f"remove of a running task: {e}")
        reason = JobTerminationReason.TERMINATED_BY_USER.value
        message = "stopped by lifecycle.py"
        timeout = 5
        started = time.monotonic()
        self.shim.client().terminate_task(
            task_id=task.id, reason=reason, message=message, timeout=timeout
        )
        took = time.monotonic() - started
        expect(took < timeout + 5, f"terminate took {took:.1f} s")
        self.wait_status(task, TaskStatus.TERMINATED, self.args.timeout)
        self.expect_terminated(task, reason, message)
        state = self.wait_container_stopped(task, self.args.timeout)["State"]
        expect(
            state["ExitCode"] == 143,
            f"container exit code {state['ExitCode']}: expected 143 (the runner's SIGTERM)",
        )
        say(f"  terminate answered in {took:.2f} s")

    def check_remove(self) -> None:
        for label in ("first", "failed", "terminated"):
            task = self.tasks[label]
            cid = task.raw.get("container_id") or self.raw(task)["container_id"]
            task_dir = self.runner_dir(task).parent
            self.shim.client().remove_task(task.id)
            self.expect_not_found(task)
            expect(
                self.docker.inspect_container(cid) is None,
                f"the container of {task.name} is still there",
            )
            expect(not task_dir.exists(), f"{task_dir} is still there")
        listed = [t.id for t in self.shim.client().list_tasks().tasks]
        expect(listed == [], f"list_tasks() after removing all: {listed}")

    def check_restart(self) -> None:
        keep = self.new_task("keep", NetworkMode.BRIDGE)
        down = self.new_task("exits-while-down", NetworkMode.BRIDGE)
        for task in (keep, down):
            self.submit(task)
        for task in (keep, down):
            self.wait_status(task, TaskStatus.RUNNING, self.args.timeout)
            self.raw(task)
        before = self.container(keep)
        expect(self.shim.client().is_safe_to_restart(), "is_safe_to_restart() is False")
        code = self.shim.sigterm(self.args.timeout)
        expect(code == 0, f"the shim exited with {code} on SIGTERM:\n{self.shim.tail()}")
        for task in (keep, down):
            expect(self.container(task)["State"]["Running"], f"{task.name} stopped with the shim")
        self.exit_runner(down, 7)
        self.wait_container_stopped(down, self.args.timeout)
        self.shim.start()
        info = self.shim.client().get_task(keep.id)
        expect(info.status == TaskStatus.RUNNING, f"after the restart: {info}")
        expect(self.raw(keep)["container_id"] == before["Id"], f"container id: {keep.raw}")
        after = self.container(keep)
        for what in ("Running", "StartedAt", "Pid"):
            expect(
                after["State"][what] == before["State"][what],
                f"container {what}: {before['State'][what]} -> {after['State'][what]}",
            )
        expect(after["RestartCount"] == before["RestartCount"], "the container restarted")

    def check_exited_while_down(self) -> None:
        task = self.tasks["exits-while-down"]
        # The first answer after the start already says it (restore and the first reconcile
        # run before the API serves).
        self.expect_terminated(task, "container_exited_with_error", "runner exiting with 7")

    def check_shutdown(self) -> None:
        keep = self.tasks["keep"]
        expect(self.shim.client().shutdown(force=False), "shutdown() returned False")
        code = self.shim.wait_exit(self.args.timeout)
        expect(code == 0, f"the shim exited with {code} after shutdown:\n{self.shim.tail()}")
        expect(self.container(keep)["State"]["Running"], "the container stopped with the shim")
        self.shim.start()
        info = self.shim.client().get_task(keep.id)
        expect(info.status == TaskStatus.RUNNING, f"after the shutdown and start: {info}")

    def check_cleanup(self) -> None:
        # The instance check's clean-up of tasks no job of the instance claims.
        instance = InstanceModel(id=uuid.uuid4(), name="lifecycle", jobs=[])
        server_instances.remove_dangling_tasks_from_instance(self.shim.client(), instance)
        listed = [t.id for t in self.shim.client().list_tasks().tasks]
        expect(listed == [], f"list_tasks() after the clean-up: {listed}")
        left = self.docker.containers_of([t.sid for t in self.tasks.values()])
        expect(left == [], f"containers left: {[c['Names'] for c in left]}")
        runners = self.shim.home / "runners"
        # The spare task directories the shim keeps ready for its next submits (`.spare-N`,
        # issue 37) are not tasks'.
        left_dirs = (
            sorted(p.name for p in runners.iterdir() if not p.name.startswith(".spare-"))
            if runners.exists()
            else []
        )
        expect(left_dirs == [], f"task directories left: {left_dirs}")
        code = self.shim.sigterm(self.args.timeout)
        expect(code == 0, f"the shim exited with {code} on SIGTERM")

    # -- driver ---------------------------------------------------------------------------

    # What each check needs to have passed. Every check needs a running shim besides: one a
    # failed check left down is started again, once (see `_running`).
    NEEDS = {
        "api": [],
        "submit": [],
        "start": ["submit"],
        "done": ["start"],
        "failed": [],
        "terminate": [],
        "remove": ["done", "failed", "terminate"],
        "restart": [],
        "exited-while-down": ["restart"],
        "shutdown": ["restart"],
        "cleanup": [],
    }

    def run(self) -> int:
        for name in CHECKS:
            failed = [n for n in self.NEEDS[name] if self.results.get(n) is not None]
            if failed:
                self.results[name] = f"not run: {', '.join(failed)} failed"
            elif name != "api" and not self._running():
                self.results[name] = "not run: the shim does not start"
            else:
                started = time.monotonic()
                self.results[name] = self._one(name)
                self.timings[name] = time.monotonic() - started
            why = self.results[name]
            say(f"ok {name}" if why is None else f"FAIL {name}: {why}")
        return sum(1 for v in self.results.values() if v is not None)

    def _running(self) -> bool:
        """Whether the shim runs; one a failed check left down is started again, but after a
        start that failed, no other is tried."""
        if self.shim.process is not None and self.shim.process.poll() is None:
            return True
        self.shim.process = None
        if self.start_failed:
            return False
        try:
            self.shim.start()
            return True
        except CheckFailed as e:
            self.start_failed = True
            say(f"  {e}")
            return False

    def _one(self, name: str) -> Optional[str]:
        method: Callable[[], None] = getattr(self, "check_" + name.replace("-", "_"))
        try:
            method()
            return None
        except CheckFailed as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a check fails with what went wrong
            return f"{e.__class__.__name__}: {e}"

    def clean_up(self) -> list[str]:
        """Removes everything this run made, however it went; what had to be forced."""
        notes = []
        if self.shim.process is not None and self.shim.process.poll() is None:
            # Through the shim first, as the server would.
            with contextlib.suppress(Exception):
                client = self.shim.client()
                for task in self.tasks.values():
                    with contextlib.suppress(Exception):
                        client.terminate_task(task_id=task.id, reason=None, message=None, timeout=0)
                    with contextlib.suppress(Exception):
                        client.remove_task(task.id)
            with contextlib.suppress(Exception):
                self.shim.sigterm(30)
        self.shim.kill()
        with contextlib.suppress(Exception):
            for c in self.docker.containers_of([t.sid for t in self.tasks.values()]):
                status = self.docker.remove_container(c["Id"])
                notes.append(f"docker rm -f {c['Names'][0].lstrip('/')}: {status}")
        if self.relay is not None:
            with contextlib.suppress(Exception):
                if self.docker.image_present(self.image):
                    self.docker.remove_image(self.image)
            self.relay.close()
        return notes


def container_ssh_key() -> str:
    """A well-formed ed25519 public key line (random; nothing logs in with it)."""
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + os.urandom(32)
    return "ssh-ed25519 " + base64.b64encode(blob).decode() + " lifecycle@dstack-shim"


def quiet_server_logs() -> None:
    """The server's code logs at warning for failed tasks; show it indented, not on stderr."""

    class Indented(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage().replace("\n", "\n    | ")
            say(f"  server log {record.levelname.lower()}: {message}")

    logger = logging.getLogger("dstack")
    logger.handlers[:] = [Indented(logging.INFO)]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    repo = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(
        description="Start a shim binary and drive its task lifecycle with the dstack "
        "server's own ShimClient and pipeline code."
    )
    parser.add_argument("--shim", type=Path, required=True, help="the dstack-shim binary")
    parser.add_argument(
        "--prefix",
        action="append",
        default=[],
        metavar="CMD",
        help="run the shim under this command (split like a shell line; repeatable), e.g. "
        "--prefix qemu-aarch64-static",
    )
    parser.add_argument(
        "--docker-host",
        default=os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock",
        help="the Docker daemon (the shim's DOCKER_HOST; default: $DOCKER_HOST, else "
        "Docker's default socket)",
    )
    parser.add_argument(
        "--image",
        default=os.environ.get("SHIM_TEST_REGISTRY", "127.0.0.1:5799") + "/shim-test:1",
        help="a registry image that runs the stub runner (busybox sh) "
        "(default: the dev-env registry's shim-test:1)",
    )
    parser.add_argument(
        "--registry-username", default=os.environ.get("SHIM_TEST_REGISTRY_USER", "shimtest")
    )
    parser.add_argument(
        "--registry-password",
        default=os.environ.get("SHIM_TEST_REGISTRY_PASSWORD", "shimtest-pw"),
    )
    parser.add_argument(
        "--no-relay",
        action="store_true",
        help="pull the image by its own name (untagged first if present) instead of through "
        "a relay of a loopback registry",
    )
    parser.add_argument(
        "--runner",
        type=Path,
        default=Path(os.environ.get("SHIM_TEST_RUNNER") or repo / "testdata/runner/dstack-runner"),
        help="the stub runner (default: testdata/runner/dstack-runner)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        help="directory for the shim home and logs (default: a new temporary directory, "
        "removed when every check passed)",
    )
    parser.add_argument("--pull-timeout", type=float, default=120, help="seconds (default 120)")
    parser.add_argument(
        "--timeout", type=float, default=90, help="bound of other waits, seconds (default 90)"
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=120,
        help="seconds the shim may take to answer after its start (default 120)",
    )
    args = parser.parse_args(argv)
    args.prefix = [word for p in args.prefix for word in shlex.split(p)]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        for what, path in (("--shim", args.shim), ("--runner", args.runner)):
            if not path.is_file() or not os.access(path, os.X_OK):
                raise SetupError(f"{what} {path}: not an executable file")
        args.shim = args.shim.resolve()
        args.runner = args.runner.resolve()
        if args.prefix and shutil.which(args.prefix[0]) is None:
            raise SetupError(f"--prefix: {args.prefix[0]} not found")
        Docker(args.docker_host).ping()
        if args.work is not None:
            args.work.mkdir(parents=True, exist_ok=True)
            work = args.work.resolve()
        else:
            work = Path(tempfile.mkdtemp(prefix="shim-lifecycle-"))
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    quiet_server_logs()
    # A caller's SIGTERM (a test's timeout) still cleans up: SystemExit runs the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shim = shlex.join(args.prefix + [str(args.shim)])
    say(
        f"dstack {dstack.version.__version__} server code; shim {shim}; "
        f"Docker {args.docker_host}; work {work}"
    )
    lifecycle = Run(args, work)
    failed = 0
    try:
        failed = lifecycle.run()
    finally:
        for note in lifecycle.clean_up():
            say(f"  clean-up: {note}")
    timings = ", ".join(f"{n} {t:.1f}s" for n, t in lifecycle.timings.items())
    say(f"  timings: {timings}; total {time.monotonic() - started:.1f} s")
    if failed:
        say(f"  shim logs kept in {work}")
    elif args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    say(f"lifecycle: {len(CHECKS) - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
