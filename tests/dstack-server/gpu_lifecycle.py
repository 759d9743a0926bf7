#!/usr/bin/env python3
"""
GPU tasks of one shim binary on one engine, driven by the dstack server's own `ShimClient`
(dstack==0.22.5), on a fake NVIDIA host the shim cannot tell from a real one
(tests/gpu-host/fake_gpu_host.py: fake device nodes, `nvidia-smi` in its real formats, a CDI
spec in /var/run/cdi naming the nodes). The shim runs under the fake host's `exec` (it sees
/dev/nvidiactl and the tool); the engine applies the CDI spec from the host.

First the shim's own decision is read (`dstack_shim_gpu_device_mode` in /metrics: `cdi`,
`legacy` or `refused`), then what that means is checked:

  mode       the decision, and why (the shim's start-up log line)
  cdi:       exactly   two tasks of 2 GPUs each run; each container sees exactly its GPUs'
                       device nodes (/dev/nvidia<i>) and their environment (the spec's per-device
                       variable in its main process), and no other's; the GPUs are disjoint
             capacity  a third task asking for 1 ends executor_error, upstream's "no capacity"
             restart   after a SIGKILL of the shim and a start, both run with the same GPUs and
                       a task asking for 1 still gets none
             remove    removing one frees its GPUs for the next task, which gets them
  legacy:    refused   a GPU task ends creating_container_error with the engine's words (no
                       NVIDIA runtime hook here: Docker's "could not select device driver")
  refused:   refused   a GPU task ends creating_container_error saying why and how to make a
                       spec, and no container was made

Output: `gpu-mode: MODE (why)`, then `ok NAME` / `FAIL NAME: why` per check, and last
`gpus: N passed, M failed`. Exit status 0 when every check passed, 1 otherwise, 2 on a setup
error. Needs root (the fake host's mknod and mount namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lifecycle  # noqa: E402  (its Shim, Docker and dstack's client)
from lifecycle import CheckFailed, Docker, Shim, ShimClient, expect, free_port, say  # noqa: E402
from dstack._internal.core.models.common import NetworkMode  # noqa: E402
from dstack._internal.server.schemas.runner import TaskStatus  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAKE_HOST = REPO / "tests/gpu-host/fake_gpu_host.py"
POLL = 0.1


def exec_output(docker: Docker, cid: str, cmd: list[str]) -> bytes:
    """`docker exec CID CMD` through the API: its stdout (the stream demultiplexed)."""
    conn = docker._connection(60)
    try:
        body = json.dumps({"Cmd": cmd, "AttachStdout": True, "AttachStderr": True})
        conn.request(
            "POST",
            f"/containers/{urllib.parse.quote(cid)}/exec",
            body=body,
            headers={"Host": "docker", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 201:
            raise CheckFailed(f"exec in {cid[:12]}: {resp.status} {data[:200]!r}")
        exec_id = json.loads(data)["Id"]
    finally:
        conn.close()
    conn = docker._connection(60)
    try:
        conn.request(
            "POST",
            f"/exec/{exec_id}/start",
            body=json.dumps({"Detach": False, "Tty": False}),
            headers={"Host": "docker", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    out = b""
    while len(raw) >= 8:
        stream, size = raw[0], struct.unpack(">I", raw[4:8])[0]
        if stream == 1:
            out += raw[8 : 8 + size]
        raw = raw[8 + size :]
    return out


class GpuRun:
    def __init__(self, args: argparse.Namespace, work: Path, host: dict) -> None:
        self.args = args
        self.host = host
        self.docker = Docker(args.docker_host)
        prefix = [sys.executable, str(FAKE_HOST), "exec", "--dir", host["dir"], "--"]
        self.shim = Shim(
            command=prefix + [str(args.shim)],
            home=work / "home",
            logs=work,
            docker_host=args.docker_host,
            runner=args.runner,
            runner_http_port=free_port(),
            runner_ssh_port=free_port(),
            start_timeout=args.start_timeout,
        )
        self.shim.home.mkdir(parents=True, exist_ok=True)
        self.run_name = f"gpu-lifecycle-{uuid.uuid4().hex[:8]}"
        self.tasks: dict[str, lifecycle.Task] = {}
        self.results: dict[str, Optional[str]] = {}
        self.mode = "unknown"
        self.why = ""

    # -- helpers ----------------------------------------------------------------------------

    def submit(self, label: str, gpu: int) -> lifecycle.Task:
        n = len(self.tasks)
        task = lifecycle.Task(uuid.uuid4(), f"{self.run_name}-0-{n}", NetworkMode.BRIDGE)
        self.tasks[label] = task
        # `_process_provisioning_with_shim`'s call for a job with GPUs.
        self.shim.client().submit_task(
            task_id=task.id,
            name=task.name,
            registry_username="",
            registry_password="",
            image_name=self.args.image,
            container_user="root",
            privileged=False,
            gpu=gpu,
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
            container_ssh_keys=[],
            instance_id="gpu-lifecycle-instance",
        )
        return task

    def wait(self, task: lifecycle.Task, status: TaskStatus) -> Any:
        deadline = time.monotonic() + self.args.timeout
        while True:
            info = self.shim.client().get_task(task.id)
            if info.status == status:
                return info
            if info.status == TaskStatus.TERMINATED:
                raise CheckFailed(
                    f"task {task.name} ended while awaiting {status.value}: "
                    f"{info.termination_reason}: {info.termination_message!r}"
                )
            if time.monotonic() > deadline:
                raise CheckFailed(f"task {task.name} still {info.status.value}")
            time.sleep(POLL)

    def raw(self, task: lifecycle.Task) -> dict[str, Any]:
        resp = self.shim.client()._request("GET", f"/api/tasks/{task.sid}", raise_for_status=True)
        return resp.json()

    def gpus_of(self, task: lifecycle.Task) -> set[str]:
        return set(self.raw(task).get("gpus_ids") or [])

    def index_of(self, uuids: set[str]) -> set[int]:
        return {g["index"] for g in self.host["gpus"] if g["uuid"] in uuids}

    def sees_exactly(self, task: lifecycle.Task) -> None:
        raw = self.raw(task)
        cid = raw["container_id"]
        mine = self.index_of(set(raw.get("gpus_ids") or []))
        expect(bool(mine), f"{task.name} has no GPUs: {raw}")
        dev = set(exec_output(self.docker, cid, ["ls", "/dev"]).decode().split())
        env = set(exec_output(self.docker, cid, ["cat", "/proc/1/environ"]).decode().split("\0"))
        for g in self.host["gpus"]:
            i = g["index"]
            node, var = f"nvidia{i}", f"DSTACK_FAKE_GPU_{i}={g['uuid']}"
            if i in mine:
                expect(node in dev, f"{task.name}: /dev/{node} missing ({sorted(dev)})")
                expect(var in env, f"{task.name}: {var} missing")
            else:
                expect(node not in dev, f"{task.name}: /dev/{node} is another task's")
                expect(var not in env, f"{task.name}: {var} is another task's")

    def expect_ended(self, task: lifecycle.Task, reason: str, has: list[str]) -> Any:
        deadline = time.monotonic() + self.args.timeout
        while (info := self.shim.client().get_task(task.id)).status != TaskStatus.TERMINATED:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{task.name} still {info.status.value}")
            time.sleep(POLL)
        expect(
            info.termination_reason == reason,
            f"{task.name}: {info.termination_reason} ({info.termination_message!r}), "
            f"expected {reason}",
        )
        for words in has:
            expect(
                words in info.termination_message,
                f"{task.name}: {info.termination_message!r} lacks {words!r}",
            )
        return info

    def remove(self, label: str) -> None:
        task = self.tasks[label]
        client = self.shim.client()
        with contextlib.suppress(Exception):
            client.terminate_task(task_id=task.id, reason=None, message=None, timeout=0)
        deadline = time.monotonic() + self.args.timeout
        while True:
            try:
                client.remove_task(task.id)
                return
            except lifecycle.runner_client.ShimResponseStatusError as e:
                if e.status_code != 409 or time.monotonic() > deadline:
                    raise
            time.sleep(POLL)

    # -- checks -------------------------------------------------------------------------------

    def read_mode(self) -> None:
        self.shim.start()
        resp = self.shim.client()._request("GET", "/metrics", raise_for_status=True)
        found = re.search(r'^dstack_shim_gpu_device_mode\{mode="(\w+)"\} 1', resp.text, re.M)
        expect(found is not None, "no dstack_shim_gpu_device_mode in /metrics")
        self.mode = found.group(1)
        log = self.shim.log_path().read_text(errors="replace")
        for line in log.splitlines():
            if "GPUs go to containers" in line or "GPU tasks cannot get their GPUs" in line:
                # The log's last field: `why=...`.
                self.why = line.split(" why=", 1)[-1][:300] if " why=" in line else line[-300:]
        say(f"gpu-mode: {self.mode} ({self.why})")

    def check_exactly(self) -> None:
        for label in ("a", "b"):
            self.submit(label, 2)
        for label in ("a", "b"):
            self.wait(self.tasks[label], TaskStatus.RUNNING)
            self.sees_exactly(self.tasks[label])
        a, b = self.gpus_of(self.tasks["a"]), self.gpus_of(self.tasks["b"])
        expect(len(a) == 2 and len(b) == 2 and not a & b, f"not disjoint: {a} {b}")

    def check_capacity(self) -> None:
        task = self.submit("none-left", 1)
        self.expect_ended(task, "executor_error", ["no capacity: 1 GPUs requested, 0 available"])
        self.remove("none-left")

    def check_restart(self) -> None:
        before = {label: self.gpus_of(self.tasks[label]) for label in ("a", "b")}
        self.shim.kill()
        self.shim.start()
        for label, gpus in before.items():
            self.wait(self.tasks[label], TaskStatus.RUNNING)
            expect(self.gpus_of(self.tasks[label]) == gpus, f"{label}'s GPUs changed")
        task = self.submit("still-none", 1)
        self.expect_ended(task, "executor_error", ["no capacity"])
        self.remove("still-none")

    def check_remove(self) -> None:
        freed = self.gpus_of(self.tasks["a"])
        self.remove("a")
        task = self.submit("c", 2)
        self.wait(task, TaskStatus.RUNNING)
        expect(self.gpus_of(task) == freed, f"c got {self.gpus_of(task)}, not a's {freed}")
        self.sees_exactly(task)

    def check_refused(self) -> None:
        task = self.submit("refused", 1)
        if self.mode == "legacy":
            has = ["could not select device driver"]
        else:
            has = ["CDI", "cdi generate"]
        info = self.expect_ended(task, "creating_container_error", has)
        say(f"  refused: {info.termination_message[:200]!r}")
        if self.mode == "refused":
            expect(
                not self.docker.containers_of([task.sid]),
                "a container was made for a task that cannot get its GPUs",
            )
        self.remove("refused")

    def run(self) -> int:
        checks: list[tuple[str, Callable[[], None]]]
        self.results["mode"] = self.one(self.read_mode)
        say("ok mode" if self.results["mode"] is None else f"FAIL mode: {self.results['mode']}")
        if self.results["mode"] is None:
            if self.mode == "cdi":
                checks = [
                    ("exactly", self.check_exactly),
                    ("capacity", self.check_capacity),
                    ("restart", self.check_restart),
                    ("remove", self.check_remove),
                ]
            else:
                checks = [("refused", self.check_refused)]
            for name, check in checks:
                failed = [n for n, why in self.results.items() if why is not None]
                if failed:
                    self.results[name] = f"not run: {', '.join(failed)} failed"
                else:
                    self.results[name] = self.one(check)
                why = self.results[name]
                say(f"ok {name}" if why is None else f"FAIL {name}: {why}")
        return sum(1 for why in self.results.values() if why is not None)

    @staticmethod
    def one(check: Callable[[], None]) -> Optional[str]:
        try:
            check()
            return None
        except CheckFailed as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a check fails with what went wrong
            return f"{e.__class__.__name__}: {e}"

    def clean_up(self) -> None:
        if self.shim.process is not None and self.shim.process.poll() is None:
            for label in list(self.tasks):
                with contextlib.suppress(Exception):
                    self.remove(label)
        self.shim.kill()
        with contextlib.suppress(Exception):
            for c in self.docker.containers_of([t.sid for t in self.tasks.values()]):
                self.docker.remove_container(c["Id"])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shim", type=Path, required=True)
    parser.add_argument(
        "--docker-host", default=os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    )
    parser.add_argument(
        "--image", default="shim-test:1", help="a local image of the engine (default shim-test:1)"
    )
    parser.add_argument(
        "--runner",
        type=Path,
        default=Path(os.environ.get("SHIM_TEST_RUNNER") or REPO / "testdata/runner/dstack-runner"),
    )
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--start-timeout", type=float, default=120)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("error: needs root (the fake GPU host)", file=sys.stderr)
        return 2
    args.shim, args.runner = args.shim.resolve(), args.runner.resolve()
    lifecycle.quiet_server_logs()
    work = Path(tempfile.mkdtemp(prefix="shim-gpu-lifecycle-"))
    host_dir = work / "gpu-host"
    setup = subprocess.run(
        [sys.executable, str(FAKE_HOST), "setup", "--dir", str(host_dir), "--vendor", "nvidia",
         "--gpus", str(args.gpus), "--docker-host", args.docker_host,
         "--owner-pid", str(os.getpid())],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if setup.returncode != 0:
        print(f"error: the fake GPU host: {setup.stderr.strip()}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return 2
    host = json.loads(setup.stdout)
    run = GpuRun(args, work, host)
    failed = 0
    try:
        failed = run.run()
    finally:
        run.clean_up()
        subprocess.run(
            [sys.executable, str(FAKE_HOST), "teardown", "--dir", str(host_dir)],
            capture_output=True, timeout=300,
        )  # fmt: skip
    if failed:
        say(f"  shim logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    say(f"gpus: {len(run.results) - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
