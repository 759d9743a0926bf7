#!/usr/bin/env python3
"""
A fake GPU host that dstack-shim cannot tell from a real one (tests; root only).

It makes what the shim and a container engine look at on a GPU host, and nothing more:

* device nodes: harmless character devices (`mknod c 1 3`, the numbers of /dev/null) under
  `<dir>/dev`, named as the vendor's driver names them (`nvidiactl`, `nvidia0`..,
  `nvidia-uvm`; `kfd`, `dri/card<i>`, `dri/renderD<128+i>`, `dri/by-path/pci-<bdf>-render`;
  `tenstorrent/<i>`);
* the vendor tool: `<dir>/bin/nvidia-smi` answers the shim's invocations in the real output
  formats (`--query-gpu=FIELDS --format=csv[,noheader][,nounits]`, `topo -m`, `-q`, `-L`);
  AMD's and Tenstorrent's tools are images (`dstackai/amd-smi:latest`, `dstackai/tt-smi:latest`,
  as upstream runs them) imported into one engine with `docker import` from a busybox root,
  printing the recorded JSON formats for the fake GPUs' bus ids;
* a CDI spec (Container Device Interface) in a directory the engine reads (default
  `/var/run/cdi`): the device names of NVIDIA's toolkit (`nvidia.com/gpu=0`, `=GPU-<uuid>`,
  `=all`; `--cdi-names legacy`: `=gpu0`) or AMD's (`amd.com/gpu=0`, `=all`), each naming the
  fake nodes by `hostPath`, so an engine that applies CDI gives a container exactly its GPUs'
  nodes;
* `exec`: runs a command in a mount namespace of its own where `/dev` has the fake nodes at
  their real paths (a tmpfs holding the host's `/dev` entries, bound, and copies of the fake
  nodes), `<dir>/bin` comes first in `PATH` and, for Tenstorrent, `/sys/module/tenstorrent/version`
  exists. The command and its children see a GPU host; the host does not.

The engine does not run in that namespace: that is why the CDI spec names host paths under
`<dir>`, and why `<dir>/bin/docker` (a wrapper of the real CLI) turns `--device /dev/kfd` (a
fake node's path, which the engine would look up on the host) into
`--device <dir>/dev/kfd:/dev/kfd`.

Subcommands (as root):

  setup --dir D --vendor nvidia|amd|tenstorrent --gpus N [--cdi-dir DIR]
        [--cdi-names index,uuid,legacy|none] [--topology NAME|plain|none] [--spec-name NAME]
        [--docker-host HOST] [--owner-pid PID] [--lock-timeout SECONDS] [--state-dir DIR]
      Makes the fake host in D (a new or empty directory) and prints D/host.json, the record of
      what was made (vendor, GPUs with uuids, bus ids and nodes, the spec, the images).
  exec --dir D [--] CMD [ARGS..]
      Runs CMD (same process id: exec, not fork) seeing the fake host as a real one.
  set-health --dir D --gpu INDEX STATE [STATE..]
      NVIDIA: what `nvidia-smi -q` reports for the GPU: healthy, retired_pages_pending,
      row_remap_pending, row_remap_failure (the shim's `UnhealthyReason` names).
  teardown --dir D [--state-dir DIR]
      Removes the spec, the images it imported (if they are still the ones it imported), the
      nodes and D, and releases the lock.

One fake host at a time per machine. CDI specs are global per engine, and two specs defining
the same device (`nvidia.com/gpu=0`) conflict, as do two images of the same name: `setup` takes
a lock (`flock` on `<state-dir>/fake-gpu-host.lock`, waiting at most `--lock-timeout`) and hands
it to a small holder process that keeps it until `teardown`. The holder also watches the owner
(`--owner-pid`, default: the process that ran `setup`): when the owner dies without a
teardown (a killed test), the holder tears the fake host down itself. A holder killed too (a
reboot, `kill -9` of everything) leaves a record in `<state-dir>/fake-gpu-hosts/`, and the next
`setup` removes what it names first.

Only the Python standard library is used; Linux only (mount namespaces, pidfd).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fcntl
import hashlib
import io
import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

# The record's format (host.json); bump on incompatible changes.
FORMAT = 1
VENDORS = ("nvidia", "amd", "tenstorrent")
MAX_GPUS = 16
DEFAULT_STATE_DIR = Path("/var/lib/dstack-shim-dev")
LOCK_NAME = "fake-gpu-host.lock"
REGISTRY_NAME = "fake-gpu-hosts"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
# The label of the images this tool imports (value: the fake host's key).
IMAGE_LABEL = "dev.dstack-shim.fake-gpu-host"
AMD_SMI_IMAGE = "dstackai/amd-smi:latest"
TT_SMI_IMAGE = "dstackai/tt-smi:latest"
BUSYBOX = Path("/bin/busybox")
# Every fake node is this character device: /dev/null's numbers (reads end at once, writes
# vanish; every engine's default device rules allow it).
NODE_MAJOR, NODE_MINOR = 1, 3
NODE_MODE = 0o666
# PCI bus numbers of the fake GPUs, in index order: the first eight are an 8-GPU H100 server's.
BUS_NUMBERS = (
    0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB,
    0x0F, 0x1B, 0x4C, 0x6E, 0x8B, 0xA0, 0xC1, 0xE3,
)  # fmt: skip
HEALTH_STATES = ("healthy", "retired_pages_pending", "row_remap_pending", "row_remap_failure")
CDI_NAME_KINDS = ("index", "uuid", "legacy")
BOUND_DOCKER = 120  # seconds one docker CLI call of setup or teardown may take
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running.\n"
)

# Where the recorded outputs are (setup copies what it uses into D/data, so that D does not
# depend on the checkout afterwards).
REPO = Path(__file__).resolve().parents[2]
TESTDATA = REPO / "crates/shim-resources/testdata/gpu"
NVIDIA_QUERY_RECORDING = TESTDATA / "health/nvidia-smi-q-a100x2.txt"
TOPO_DIR = TESTDATA / "topo"
AMD_SMI_RECORDING = TESTDATA / "amd-smi-rocm7.json"
TT_SMI_RECORDING = TESTDATA / "tenstorrent/single_n150_gpu.json"


class Failure(Exception):
    """A failure to report in one line (exit status 1)."""


def say(message: str) -> None:
    print(f"fake-gpu-host: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- records


def host_key(d: Path) -> str:
    """A short name of the fake host at `d` (its images' label, its spec's default name)."""
    return hashlib.sha256(str(d).encode()).hexdigest()[:12]


def gpu_uuid(d: Path, index: int) -> str:
    """`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the same for the same directory and index."""
    h = hashlib.sha256(f"dstack-shim-fake-gpu\0{d}\0{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def serial_number(d: Path, index: int) -> str:
    h = hashlib.sha256(f"dstack-shim-fake-serial\0{d}\0{index}".encode()).hexdigest()
    return f"{int(h, 16) % 10**13:013d}"


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Writes `path` by a temporary file beside it and a rename (a reader, such as an engine
    reading its CDI directory, never sees half a file: the temporary's name ends in `.tmp`)."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, raw)
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_record(d: Path) -> dict:
    try:
        return read_json(d / "host.json")
    except FileNotFoundError:
        raise Failure(f"{d}/host.json: no fake GPU host there (run setup first)") from None


# -------------------------------------------------------------------------------- mounts (libc)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 0x2


def _enc(value: Optional[str | Path]) -> Optional[bytes]:
    return None if value is None else os.fsencode(value)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: Optional[str | Path], target: str | Path, fstype: Optional[str], flags: int,
          data: Optional[str] = None) -> None:
    _check(
        _libc.mount(_enc(source), _enc(target), _enc(fstype), ctypes.c_ulong(flags), _enc(data)),
        f"mount {source} on {target}",
    )


def umount_detach(target: str | Path) -> None:
    _check(_libc.umount2(_enc(target), MNT_DETACH), f"umount {target}")


# ------------------------------------------------------------------------------ host facts


def bus_number(index: int) -> int:
    return BUS_NUMBERS[index]


def nvidia_bus_id(index: int) -> str:
    """As nvidia-smi prints it: `00000000:3B:00.0`."""
    return f"00000000:{bus_number(index):02X}:00.0"


def bdf(index: int) -> str:
    """As amd-smi and tt-smi print it: `0000:3b:00.0`."""
    return f"0000:{bus_number(index):02x}:00.0"


def nvidia_model() -> dict:
    """The fake NVIDIA GPU: the recorded `nvidia-smi -q` GPU's name, memory, driver and CUDA."""
    text = NVIDIA_QUERY_RECORDING.read_text()

    def field(key: str) -> str:
        m = re.search(rf"^\s*{re.escape(key)}\s*: (.*)$", text, re.MULTILINE)
        if m is None:
            raise Failure(f"{NVIDIA_QUERY_RECORDING}: no {key!r}")
        return m.group(1).strip()

    total = re.search(r"FB Memory Usage\n\s*Total\s*: (\d+) MiB", text)
    if total is None:
        raise Failure(f"{NVIDIA_QUERY_RECORDING}: no FB Memory Usage total")
    return {
        "name": field("Product Name"),
        "memory_mib": int(total.group(1)),
        "driver_version": field("Driver Version"),
        "cuda_version": field("CUDA Version"),
    }


def plan(d: Path, vendor: str, n: int) -> dict:
    """What the fake host has: the record without the spec, images and holder."""
    gpus: list[dict] = []
    control: list[dict] = []
    if vendor == "nvidia":
        model = nvidia_model()
        for i in range(n):
            gpus.append({
                "index": i,
                "uuid": gpu_uuid(d, i),
                "id": gpu_uuid(d, i),
                "name": model["name"],
                "memory_mib": model["memory_mib"],
                "bus_id": nvidia_bus_id(i),
                "serial": serial_number(d, i),
                "nodes": [f"/dev/nvidia{i}"],
            })
        control = [{"path": f"/dev/{name}"} for name in
                   ("nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl")]
        driver = model["driver_version"]
        extra = {"cuda_version": model["cuda_version"]}
    elif vendor == "amd":
        recorded = read_json(AMD_SMI_RECORDING)["gpu_data"][0]
        for i in range(n):
            gpus.append({
                "index": i,
                "uuid": gpu_uuid(d, i),
                # The shim's id of an AMD GPU is its render node (resolved by-path link).
                "id": f"/dev/dri/renderD{128 + i}",
                "name": recorded["asic"]["market_name"],
                "memory_mib": recorded["vram"]["size"]["value"],
                "bus_id": bdf(i),
                "nodes": [f"/dev/dri/card{i}", f"/dev/dri/renderD{128 + i}"],
            })
        control = [{"path": "/dev/kfd"}]
        driver = recorded["driver"]["version"]
        extra = {}
    else:
        recorded = read_json(TT_SMI_RECORDING)["device_info"][0]["board_info"]
        for i in range(n):
            gpus.append({
                "index": i,
                "uuid": gpu_uuid(d, i),
                "id": str(i),
                "name": recorded["board_type"].split()[0],
                "memory_mib": 12 * 1024,
                "bus_id": bdf(i),
                "board_id": f"{int(recorded['board_id'], 16) + i:x}",
                "nodes": [f"/dev/tenstorrent/{i}"],
            })
        driver = read_json(TT_SMI_RECORDING)["host_info"]["Driver"].split()[-1]
        extra = {}
    for g in gpus:
        g["host_nodes"] = [str(d / node[1:]) for node in g["nodes"]]
    for c in control:
        c["host_path"] = str(d / c["path"][1:])
    return {
        "format": FORMAT,
        "dir": str(d),
        "key": host_key(d),
        "vendor": vendor,
        "driver_version": driver,
        "gpus": gpus,
        "control_nodes": control,
        **extra,
    }


# ----------------------------------------------------------------------------------- nodes


def make_node(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | NODE_MODE, os.makedev(NODE_MAJOR, NODE_MINOR))
    os.chmod(path, NODE_MODE)


def make_host_nodes(record: dict) -> None:
    """`--host-nodes`: the vendor's nodes also at their real paths on the host (`/dev/kfd`,
    `/dev/dri/renderD128`, `/dev/tenstorrent/0`, ...), where the engine looks up a plain device
    mapping (upstream's AMD and Tenstorrent mappings, which CDI's hostPath cannot redirect).
    Only paths that do not exist are made, each recorded (with the directories made for them)
    so the teardown removes exactly those. Every shim that detects GPUs while they exist sees
    this vendor: callers run alone (.config/nextest.toml)."""
    made: list[str] = []
    dirs: list[str] = []
    record["host_nodes"] = {"nodes": made, "dirs": dirs}
    paths = [c["path"] for c in record["control_nodes"]]
    paths += [node for g in record["gpus"] for node in g["nodes"]]
    for path in map(Path, paths):
        missing = []
        parent = path.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            directory.mkdir(mode=0o755)
            dirs.append(str(directory))
        if not path.exists():
            make_node(path)
            made.append(str(path))


def remove_host_nodes(record: dict) -> list[str]:
    problems: list[str] = []
    made = record.get("host_nodes") or {}
    for node in made.get("nodes", []):
        try:
            Path(node).unlink(missing_ok=True)
        except OSError as e:
            problems.append(f"cannot remove {node}: {e}")
    for directory in reversed(made.get("dirs", [])):
        try:
            Path(directory).rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            problems.append(f"cannot remove {directory}: {e}")
    return problems


def make_nodes(d: Path, record: dict) -> None:
    for c in record["control_nodes"]:
        make_node(Path(c["host_path"]))
    for g in record["gpus"]:
        for node in g["host_nodes"]:
            make_node(Path(node))
    if record["vendor"] == "amd":
        by_path = d / "dev/dri/by-path"
        by_path.mkdir(parents=True, exist_ok=True)
        for g in record["gpus"]:
            card, render = (Path(n).name for n in g["nodes"])
            os.symlink(f"../{card}", by_path / f"pci-{g['bus_id']}-card")
            os.symlink(f"../{render}", by_path / f"pci-{g['bus_id']}-render")


# ------------------------------------------------------------------------------- nvidia-smi

# --query-gpu fields: name -> (value of a GPU at a position among `count` visible, unit).
QUERY_FIELDS: dict[str, tuple[Any, Optional[str]]] = {
    "name": (lambda g, pos, count: g["name"], None),
    "memory.total": (lambda g, pos, count: str(g["memory_mib"]), "MiB"),
    "uuid": (lambda g, pos, count: g["uuid"], None),
    "driver_version": (lambda g, pos, count: g["driver_version"], None),
    "index": (lambda g, pos, count: str(pos), None),
    "pci.bus_id": (lambda g, pos, count: g["bus_id"], None),
    "count": (lambda g, pos, count: str(count), None),
    "serial": (lambda g, pos, count: g["serial"], None),
}
QUERY_ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
    "gpu_serial": "serial",
}


def smi_usage(argv: list[str]) -> int:
    sys.stderr.write(
        f"fake nvidia-smi (dstack-shim tests/gpu-host): not recorded: {' '.join(argv)}\n"
        "recorded: -L, --query-gpu=FIELDS --format=csv[,noheader][,nounits], topo -m, -q\n"
    )
    return 2


def nvidia_smi_main(d: Path, argv: list[str]) -> int:
    """The host's `nvidia-smi`: GPUs whose node `/dev/nvidia<i>` exists (all of them inside
    `exec`; none outside, where it fails as without a driver)."""
    record = load_record(d)
    if not Path("/dev/nvidiactl").exists():
        sys.stdout.write(NO_DRIVER)
        return 9
    visible = [g for g in record["gpus"] if Path(f"/dev/nvidia{g['index']}").exists()]
    for g in visible:
        g["driver_version"] = record["driver_version"]
    if argv[:1] == ["topo"]:
        if argv[1:] not in (["-m"], ["--matrix"]):
            return smi_usage(argv)
        topo = d / "data/topo.txt"
        if not topo.exists():
            sys.stderr.write("fake nvidia-smi: this fake host has no topology (--topology none)\n")
            return 1
        sys.stdout.write(topo.read_text())
        return 0
    if not visible:
        sys.stdout.write("No devices were found\n")
        return 6
    if argv in (["-L"], ["--list-gpus"]):
        for pos, g in enumerate(visible):
            print(f"GPU {pos}: {g['name']} (UUID: {g['uuid']})")
        return 0
    if argv in (["-q"], ["--query"]):
        sys.stdout.write(nvidia_query(d, record, visible))
        return 0
    query: Optional[str] = None
    fmt: Optional[str] = None
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--query-gpu="):
            query = arg.split("=", 1)[1]
        elif arg == "--query-gpu" and rest:
            query = rest.pop(0)
        elif arg.startswith("--format="):
            fmt = arg.split("=", 1)[1]
        elif arg == "--format" and rest:
            fmt = rest.pop(0)
        else:
            return smi_usage(argv)
    if query is None or fmt is None:
        return smi_usage(argv)
    options = [o.strip() for o in fmt.split(",")]
    if "csv" not in options or not set(options) <= {"csv", "noheader", "nounits"}:
        return smi_usage(argv)
    fields = [f.strip() for f in query.split(",")]
    names = [QUERY_ALIASES.get(f, f) for f in fields]
    for f, name in zip(fields, names):
        if name not in QUERY_FIELDS:
            sys.stdout.write(f'Field "{f}" is not a valid field to query.\n\n')
            return 2
    if "noheader" not in options:
        print(", ".join(n + (f" [{QUERY_FIELDS[n][1]}]" if QUERY_FIELDS[n][1] else "")
                        for n in names))
    for pos, g in enumerate(visible):
        values = []
        for name in names:
            value_of, unit = QUERY_FIELDS[name]
            value = value_of(g, pos, len(visible))
            if unit and "nounits" not in options:
                value = f"{value} {unit}"
            values.append(value)
        print(", ".join(values))
    return 0


FIELD_LINE = re.compile(r"^(\s*)(\S.*?)(\s*: )(.*)$")


def nvidia_query(d: Path, record: dict, visible: list[dict]) -> str:
    """`nvidia-smi -q`: the recorded report's layout (its header and its first GPU's section
    for every GPU), with each GPU's identity and the health state of D/state.json written in
    where the recorded faults show it (see crates/shim-resources/testdata/gpu/health)."""
    lines = (d / "data/nvidia-smi-q.txt").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("GPU ")]
    if not starts:
        raise Failure("the recorded nvidia-smi -q has no GPU section")
    header = lines[: starts[0]]
    end = starts[1] if len(starts) > 1 else len(lines)
    section = lines[starts[0] : end]
    while section and not section[-1].strip():
        section.pop()
    health = read_health(d)
    out: list[str] = []
    for line in header:
        m = FIELD_LINE.match(line)
        if m and m.group(2) == "Timestamp":
            line = m.group(1) + m.group(2) + m.group(3) + time.strftime("%a %b %e %H:%M:%S %Y")
        elif m and m.group(2) == "Driver Version":
            line = m.group(1) + m.group(2) + m.group(3) + record["driver_version"]
        elif m and m.group(2) == "Attached GPUs":
            line = m.group(1) + m.group(2) + m.group(3) + str(len(visible))
        out.append(line)
    for n, g in enumerate(visible):
        if n:
            out.append("")
        out.extend(gpu_query_section(section, g, health.get(str(g["index"]), [])))
    return "\n".join(out) + "\n"


def gpu_query_section(section: list[str], g: dict, reasons: list[str]) -> Iterator[str]:
    bus = bus_number(g["index"])
    retired = "retired_pages_pending" in reasons
    remap_pending = "row_remap_pending" in reasons
    remap_failed = "row_remap_failure" in reasons
    yes_no = lambda b: "Yes" if b else "No"  # noqa: E731
    values = {
        ((), "Product Name"): g["name"],
        ((), "Serial Number"): g["serial"],
        ((), "GPU UUID"): g["uuid"],
        ((), "Minor Number"): str(g["index"]),
        ((), "Board ID"): f"0x{bus:02x}00",
        ((), "Module ID"): str(g["index"] + 1),
        ((), "GSP Firmware Version"): g["driver_version"],
        (("PCI",), "Bus"): f"0x{bus:02X}",
        (("PCI",), "Bus Id"): g["bus_id"],
        (("FB Memory Usage",), "Total"): f"{g['memory_mib']} MiB",
        (("FB Memory Usage",), "Free"): f"{g['memory_mib'] - 564} MiB",
        (("Retired Pages",), "Single Bit ECC"): "0" if retired else "N/A",
        (("Retired Pages",), "Double Bit ECC"): "1" if retired else "N/A",
        (("Retired Pages",), "Pending Page Blacklist"): "Yes" if retired else "N/A",
        (("Remapped Rows",), "Uncorrectable Error"): "1" if remap_pending else "0",
        (("Remapped Rows",), "Pending"): yes_no(remap_pending),
        (("Remapped Rows",), "Remapping Failure Occurred"): yes_no(remap_failed),
        (("Remapped Rows", "Bank Remap Availability Histogram"), "Max"):
            "639 bank(s)" if remap_pending else "640 bank(s)",
        (("Remapped Rows", "Bank Remap Availability Histogram"), "High"):
            "1 bank(s)" if remap_pending else "0 bank(s)",
    }
    path: list[tuple[int, str]] = []
    for line in section:
        if line.startswith("GPU "):
            yield f"GPU {g['bus_id']}"
            continue
        indent = len(line) - len(line.lstrip())
        while path and path[-1][0] >= indent:
            path.pop()
        m = FIELD_LINE.match(line)
        if m is None:
            if line.strip():
                path.append((indent, line.strip()))
            yield line
            continue
        key = (tuple(p for _, p in path), m.group(2))
        yield m.group(1) + m.group(2) + m.group(3) + values[key] if key in values else line


def read_health(d: Path) -> dict[str, list[str]]:
    try:
        return read_json(d / "state.json").get("health", {})
    except FileNotFoundError:
        return {}


# The nvidia-smi of containers (busybox sh and awk: images have no Python): the GPUs whose node
# the container has, numbered from 0 as the real one numbers what a container sees.
CONTAINER_SMI = r"""#!/bin/sh
# nvidia-smi of a fake GPU host (dstack-shim tests/gpu-host/fake_gpu_host.py), mounted into
# containers by its CDI spec. It lists the host's GPUs whose device node /dev/nvidia<minor> the
# container has, numbered from 0 as the real one numbers the GPUs a container sees.
# Recorded: -L, --query-gpu=FIELDS --format=csv[,noheader][,nounits] with FIELDS from name,
# memory.total, uuid, driver_version, index, pci.bus_id, count, serial.
# minor|name|memory MiB|uuid|driver|bus id|serial
GPUS='@GPUS@'
list=0 query= format=
while [ $# -gt 0 ]; do
  case "$1" in
    -L|--list-gpus) list=1 ;;
    --query-gpu=*) query="${1#*=}" ;;
    --format=*) format="${1#*=}" ;;
    *) echo "fake nvidia-smi: not recorded: $*" >&2; exit 2 ;;
  esac
  shift
done
if [ ! -e /dev/nvidiactl ]; then
  echo "@NO_DRIVER@"
  exit 9
fi
visible=$(echo "$GPUS" | while IFS='|' read -r minor rest; do
  if [ -e "/dev/nvidia$minor" ]; then echo "$minor|$rest"; fi
done)
if [ -z "$visible" ]; then echo "No devices were found"; exit 6; fi
if [ "$list" = 1 ]; then
  echo "$visible" | awk -F'|' '{ printf "GPU %d: %s (UUID: %s)\n", NR - 1, $2, $4 }'
  exit 0
fi
case ",$format," in
  *,csv,*) ;;
  *) echo "fake nvidia-smi: give -L or --query-gpu=FIELDS --format=csv" >&2; exit 2 ;;
esac
echo "$visible" | awk -F'|' -v query="$query" -v format=",$format," '
  { row[NR] = $0 }
  END {
    nf = split(query, f, ",")
    for (j = 1; j <= nf; j++) {
      gsub(/ /, "", f[j])
      name = f[j]
      if (name == "gpu_name") name = "name"
      if (name == "gpu_uuid") name = "uuid"
      if (name == "gpu_bus_id") name = "pci.bus_id"
      if (name == "gpu_serial") name = "serial"
      if (name !~ /^(name|memory\.total|uuid|driver_version|index|pci\.bus_id|count|serial)$/) {
        printf "Field \"%s\" is not a valid field to query.\n\n", f[j]
        exit 2
      }
      canon[j] = name
    }
    if (format !~ /,noheader,/) {
      line = ""
      for (j = 1; j <= nf; j++)
        line = line (j > 1 ? ", " : "") canon[j] (canon[j] == "memory.total" ? " [MiB]" : "")
      print line
    }
    for (r = 1; r <= NR; r++) {
      split(row[r], g, "|")
      line = ""
      for (j = 1; j <= nf; j++) {
        c = canon[j]
        if (c == "name") v = g[2]
        else if (c == "memory.total") v = g[3] (format ~ /,nounits,/ ? "" : " MiB")
        else if (c == "uuid") v = g[4]
        else if (c == "driver_version") v = g[5]
        else if (c == "index") v = r - 1
        else if (c == "pci.bus_id") v = g[6]
        else if (c == "count") v = NR
        else v = g[7]
        line = line (j > 1 ? ", " : "") v
      }
      print line
    }
  }'
"""


def container_smi(record: dict) -> str:
    rows = "\n".join(
        "|".join([str(g["index"]), g["name"], str(g["memory_mib"]), g["uuid"],
                  record["driver_version"], g["bus_id"], g["serial"]])
        for g in record["gpus"]
    )
    return CONTAINER_SMI.replace("@GPUS@", rows).replace("@NO_DRIVER@", NO_DRIVER.strip())


# ------------------------------------------------------------------------------- topology


def cpu_ranges() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    ranges: list[str] = []
    start = prev = cpus[0]
    for c in cpus[1:] + [-2]:
        if c != prev + 1:
            ranges.append(f"{start}-{prev}" if prev != start else str(start))
            start = c
        prev = c
    return ",".join(ranges)


def plain_topology(n: int) -> str:
    """`nvidia-smi topo -m` of N PCIe GPUs on one NUMA node, each pair `NODE`, in the layout of
    a recent driver (the recorded mixed-2numa-5gpu.txt), legend included."""
    width = 8
    cell = lambda s: s.ljust(width)  # noqa: E731
    header = " " * width + "".join(cell(f"GPU{j}") for j in range(n))
    header += "CPU Affinity    NUMA Affinity   GPU NUMA ID"
    rows = [header]
    affinity = cpu_ranges()
    for i in range(n):
        cells = "".join(cell(" X " if i == j else "NODE") for j in range(n))
        rows.append(cell(f"GPU{i}") + cells + affinity.ljust(16) + "0".ljust(16) + "N/A")
    legend = (TOPO_DIR / "mixed-2numa-5gpu.txt").read_text().split("\n\nLegend:", 1)[1]
    return "\n".join(rows) + "\n\nLegend:" + legend


def topology_gpus(text: str) -> int:
    header = next((line for line in text.splitlines() if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        return 0
    return sum(1 for f in header.split() if re.fullmatch(r"GPU\d+", f))


def recorded_topologies() -> list[str]:
    return sorted(p.stem for p in TOPO_DIR.glob("*.txt"))


def topology_text(name: str, n: int) -> Optional[str]:
    if name == "none":
        return None
    if name == "plain":
        return plain_topology(n)
    path = TOPO_DIR / f"{name}.txt"
    if not path.is_file():
        raise Failure(
            f"--topology {name}: no such recording; one of plain, none, "
            + ", ".join(recorded_topologies())
        )
    text = path.read_text()
    if topology_gpus(text) != n:
        raise Failure(f"--topology {name} has {topology_gpus(text)} GPUs, not --gpus {n}")
    return text


# ------------------------------------------------------------------------------------- CDI


def cdi_device_names(kinds: list[str], g: dict) -> list[str]:
    names = []
    for kind in kinds:
        if kind == "index":
            names.append(str(g["index"]))
        elif kind == "uuid":
            names.append(g["uuid"])
        elif kind == "legacy":
            names.append(f"gpu{g['index']}")
    return names


def node_edit(path: str, host_path: str, with_numbers: bool) -> dict:
    node: dict = {"path": path, "hostPath": host_path}
    if with_numbers:
        node.update({"type": "c", "major": NODE_MAJOR, "minor": NODE_MINOR})
    return node


def nvidia_spec(record: dict, kinds: list[str], d: Path) -> dict:
    """The spec `nvidia-ctk cdi generate` writes (its layout, less its hooks and driver
    libraries), with host paths under D and an env variable per device for tests."""
    devices = []
    for g in record["gpus"]:
        for name in cdi_device_names(kinds, g):
            devices.append({
                "name": name,
                "containerEdits": {
                    "deviceNodes": [node_edit(p, h, False) for p, h in
                                    zip(g["nodes"], g["host_nodes"])],
                    "env": [f"DSTACK_FAKE_GPU_{g['index']}={g['uuid']}"],
                },
            })
    devices.append({
        "name": "all",
        "containerEdits": {
            "deviceNodes": [node_edit(p, h, False) for g in record["gpus"]
                            for p, h in zip(g["nodes"], g["host_nodes"])],
            "env": [f"DSTACK_FAKE_GPU_{g['index']}={g['uuid']}" for g in record["gpus"]],
        },
    })
    return {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void", f"DSTACK_FAKE_GPU_HOST={d}"],
            "deviceNodes": [node_edit(c["path"], c["host_path"], False)
                            for c in record["control_nodes"]],
            "mounts": [{
                "hostPath": str(d / "container/nvidia-smi"),
                "containerPath": "/usr/bin/nvidia-smi",
                "options": ["ro", "nosuid", "nodev", "bind"],
            }],
        },
        "devices": devices,
    }


def amd_spec(record: dict, d: Path) -> dict:
    """The spec AMD's container toolkit writes (`amd-ctk cdi generate`: a device per index with
    its card and render nodes and /dev/kfd, and `all`), with host paths under D and an env
    variable per device for tests."""
    kfd = record["control_nodes"][0]
    devices = []
    for g in record["gpus"]:
        nodes = [node_edit(p, h, True) for p, h in zip(g["nodes"], g["host_nodes"])]
        devices.append({
            "name": str(g["index"]),
            "containerEdits": {
                "env": [f"DSTACK_FAKE_GPU_{g['index']}={g['id']}"],
                "deviceNodes": nodes + [node_edit(kfd["path"], kfd["host_path"], True)],
            },
        })
    devices.append({
        "name": "all",
        "containerEdits": {
            "env": [f"DSTACK_FAKE_GPU_{g['index']}={g['id']}" for g in record["gpus"]],
            "deviceNodes": [node_edit(p, h, True) for g in record["gpus"]
                            for p, h in zip(g["nodes"], g["host_nodes"])]
            + [node_edit(kfd["path"], kfd["host_path"], True)],
        },
    })
    return {"cdiVersion": "0.6.0", "kind": "amd.com/gpu", "devices": devices}


YAML_PLAIN = re.compile(r"[A-Za-z0-9/_.][A-Za-z0-9/_.=,+:@-]*")
YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    s = str(value)

    def number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    if YAML_PLAIN.fullmatch(s) and s.lower() not in YAML_WORDS and not number(s):
        return s
    return json.dumps(s)  # a JSON string is a YAML double-quoted scalar


def yaml_lines(value: Any, indent: int) -> Iterator[str]:
    """YAML as `sigs.k8s.io/yaml` writes it (nvidia-ctk): keys sorted, list items at their
    key's indentation."""
    pad = " " * indent
    if isinstance(value, dict):
        for key in sorted(value):
            v = value[key]
            if isinstance(v, dict) and v:
                yield f"{pad}{key}:"
                yield from yaml_lines(v, indent + 2)
            elif isinstance(v, list) and v:
                yield f"{pad}{key}:"
                yield from yaml_lines(v, indent)
            elif isinstance(v, (dict, list)):
                yield f"{pad}{key}: {json.dumps(v)}"  # empty: {} or []
            else:
                yield f"{pad}{key}: {yaml_scalar(v)}"
    else:
        for item in value:
            if isinstance(item, dict) and item:
                lines = list(yaml_lines(item, indent + 2))
                yield f"{pad}- {lines[0][indent + 2:]}"
                yield from lines[1:]
            else:
                yield f"{pad}- {yaml_scalar(item)}"


def to_yaml(value: dict) -> str:
    return "---\n" + "\n".join(yaml_lines(value, 0)) + "\n"


# ---------------------------------------------------------------------------------- images

AMD_SMI_SCRIPT = r"""#!/bin/sh
# amd-smi of a fake GPU host (dstack-shim tests/gpu-host/fake_gpu_host.py): answers
# `static --json [--asic] [--vram] [--bus] [--driver]` with amd-smi's ROCm 7 JSON for the fake
# GPUs (crates/shim-resources/testdata/gpu/amd-smi-rocm7.json, one entry per GPU, their bus ids).
# Like the real one it needs the GPUs: run it with --device /dev/kfd --device /dev/dri.
if [ "$1" != static ]; then echo "fake amd-smi: not recorded: $*" >&2; exit 2; fi
shift
json=0
sections=
for arg; do
  case "$arg" in
    --json) json=1 ;;
    --asic|--vram|--bus|--driver) sections="$sections ${arg#--}" ;;
    *) echo "fake amd-smi: not recorded: static $*" >&2; exit 2 ;;
  esac
done
if [ "$json" != 1 ]; then echo "fake amd-smi: only --json is recorded" >&2; exit 2; fi
if [ ! -e /dev/kfd ]; then
  echo "ERROR:root:Unable to detect any GPU devices, check amdgpu version and module" \
    "status (sudo modprobe amdgpu)" >&2
  exit 1
fi
[ -n "$sections" ] || sections="asic bus driver vram"
key=$(for s in $sections; do echo "$s"; done | sort -u | tr '\n' '-')
exec cat "/usr/share/fake-amd-smi/static-${key%-}.json"
"""

TT_SMI_SCRIPT = r"""#!/bin/sh
# tt-smi of a fake GPU host (dstack-shim tests/gpu-host/fake_gpu_host.py): answers `-s` with a
# snapshot in the recorded format (crates/shim-resources/testdata/gpu/tenstorrent/
# single_n150_gpu.json, one n150 board per fake GPU, their bus ids). Like the real one it needs
# the devices: run it with --device /dev/tenstorrent.
if [ "$*" != "-s" ]; then echo "fake tt-smi: not recorded: $*" >&2; exit 2; fi
if [ ! -d /dev/tenstorrent ]; then
  echo "No Tenstorrent driver detected! Please install driver using tt-kmd" >&2
  exit 1
fi
exec cat /usr/share/fake-tt-smi/snapshot.json
"""


def amd_smi_outputs(record: dict) -> dict[str, str]:
    """`static-<sections joined by ->.json` for every non-empty set of sections."""
    recorded = read_json(AMD_SMI_RECORDING)["gpu_data"][0]
    names = ["asic", "bus", "driver", "vram"]
    outputs = {}
    for mask in range(1, 16):
        chosen = [s for bit, s in enumerate(names) if mask & (1 << bit)]
        data = []
        for g in record["gpus"]:
            entry: dict = {"gpu": g["index"]}
            for section in ("asic", "bus", "vram", "driver"):
                if section not in chosen:
                    continue
                value = json.loads(json.dumps(recorded[section]))
                if section == "bus":
                    value["bdf"] = g["bus_id"]
                entry[section] = value
            data.append(entry)
        outputs[f"static-{'-'.join(chosen)}.json"] = json.dumps({"gpu_data": data}, indent=4) + "\n"
    return outputs


def tt_smi_snapshot(record: dict) -> str:
    recorded = read_json(TT_SMI_RECORDING)
    template = recorded["device_info"][0]
    devices = []
    for g in record["gpus"]:
        device = json.loads(json.dumps(template))
        device["board_info"]["bus_id"] = g["bus_id"]
        device["board_info"]["board_id"] = g["board_id"]
        device["board_info"]["coords"] = f"({g['index']}, 0, 0, 0)"
        board = int(g["board_id"], 16)
        device["smbus_telem"]["BOARD_ID"] = f"0x{board:x}"
        device["smbus_telem"]["BOARD_ID_HIGH"] = f"0x{board >> 32:x}"
        device["smbus_telem"]["BOARD_ID_LOW"] = f"0x{board & 0xFFFFFFFF:x}"
        devices.append(device)
    snapshot = dict(recorded)
    snapshot["time"] = time.strftime("%Y-%m-%dT%H:%M:%S.000000")
    snapshot["device_info"] = devices
    return json.dumps(snapshot, indent=4) + "\n"


def image_tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A busybox root file system (every applet linked in /bin) with `files` (path -> content,
    mode), as a tar for `docker import`."""
    if not BUSYBOX.is_file():
        raise Failure(
            f"{BUSYBOX} is missing (Debian's busybox-static; cargo xtask dev-env installs it)"
        )
    applets = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = mode
            tar.addfile(info)

        def add_file(name: str, data: bytes, mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))

        dirs = {"bin", "tmp", "usr", "usr/bin", "usr/share"}
        for path in files:
            parts = path.split("/")[:-1]
            dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        for name in sorted(dirs):
            add_dir(name, 0o1777 if name == "tmp" else 0o755)
        add_file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        for applet in applets:
            if applet == "busybox":
                continue
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
        for path, (data, mode) in sorted(files.items()):
            add_file(path, data, mode)
    return buf.getvalue()


def docker(docker_host: str, args: list[str], stdin: Optional[bytes] = None,
           check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, DOCKER_HOST=docker_host)
    try:
        done = subprocess.run(["docker", *args], input=stdin, capture_output=True, env=env,
                              timeout=BOUND_DOCKER)
    except subprocess.TimeoutExpired:
        raise Failure(
            f"docker {' '.join(args)} ({docker_host}) took over {BOUND_DOCKER} s"
        ) from None
    if check and done.returncode != 0:
        raise Failure(f"docker {' '.join(args)} ({docker_host}) failed: "
                      f"{done.stderr.decode(errors='replace').strip()}")
    return done


def image_id(docker_host: str, ref: str) -> Optional[str]:
    done = docker(docker_host, ["image", "inspect", "--format", "{{.Id}}", ref], check=False)
    return done.stdout.decode().strip() if done.returncode == 0 else None


def image_label(docker_host: str, ref: str) -> Optional[str]:
    fmt = "{{index .Config.Labels \"" + IMAGE_LABEL + "\"}}"
    done = docker(docker_host, ["image", "inspect", "--format", fmt, ref], check=False)
    value = done.stdout.decode().strip()
    return value if done.returncode == 0 and value not in ("", "<no value>") else None


def import_image(docker_host: str, ref: str, key: str, entrypoint: str,
                 files: dict[str, tuple[bytes, int]]) -> dict:
    """Imports the tool image `ref`. An image of that name that this tool did not make is left
    alone (setup fails); one it made (a killed run's) is replaced."""
    old = image_id(docker_host, ref)
    if old is not None and image_label(docker_host, ref) is None:
        raise Failure(
            f"{ref} exists on {docker_host} and is not a fake GPU host's image: remove it, or "
            "use another engine"
        )
    docker(docker_host, [
        "import",
        "--change", f"LABEL {IMAGE_LABEL}={key}",
        "--change", f'ENTRYPOINT ["{entrypoint}"]',
        "--message", "dstack-shim fake GPU host (tests/gpu-host/fake_gpu_host.py)",
        "-", ref,
    ], stdin=image_tar(files))
    new = image_id(docker_host, ref)
    if new is None:
        raise Failure(f"{ref} is not on {docker_host} after docker import")
    if old is not None and old != new:
        docker(docker_host, ["image", "rm", old], check=False)
    return {"ref": ref, "id": new, "docker_host": docker_host}


# --------------------------------------------------------------------------- lock, registry


def lock_path(state_dir: Path) -> Path:
    return state_dir / LOCK_NAME


def registry_dir(state_dir: Path) -> Path:
    return state_dir / REGISTRY_NAME


def take_lock(state_dir: Path, timeout: float, d: Path) -> int:
    """The lock's file descriptor, locked (waits at most `timeout` seconds)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(state_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = path.read_text().strip() or "?"
                os.close(fd)
                raise Failure(
                    f"the fake GPU host lock {path} is still held after {timeout:g} s (by "
                    f"{holder}); one fake GPU host at a time: tear the other down"
                ) from None
            if not told:
                say(f"waiting for the lock {path} (held by {path.read_text().strip() or '?'})")
                told = True
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{d} (setup pid {os.getpid()})\n".encode(), 0)
    return fd


def register(state_dir: Path, record: dict) -> None:
    reg = registry_dir(state_dir)
    reg.mkdir(parents=True, exist_ok=True)
    write_atomic(reg / f"{record['key']}.json", json.dumps(record, indent=2) + "\n")


def reap_stale(state_dir: Path) -> None:
    """With the lock held, no other fake host is alive: remove what killed ones left."""
    reg = registry_dir(state_dir)
    for entry in sorted(reg.glob("*.json")) if reg.is_dir() else []:
        try:
            record = read_json(entry)
        except (OSError, ValueError) as e:
            say(f"removing an unreadable record {entry}: {e}")
            entry.unlink(missing_ok=True)
            continue
        say(f"removing a fake GPU host a killed run left: {record.get('dir')}")
        for problem in remove_host(record, state_dir):
            say(f"  {problem}")


def remove_host(record: dict, state_dir: Path) -> list[str]:
    """Removes the spec, the images (still the ones imported), D and the record; idempotent.
    Returns what could not be removed."""
    problems: list[str] = remove_host_nodes(record)
    spec = record.get("cdi", {}).get("spec")
    if spec:
        try:
            Path(spec).unlink(missing_ok=True)
        except OSError as e:
            problems.append(f"cannot remove {spec}: {e}")
    for image in record.get("images", []):
        try:
            if image_id(image["docker_host"], image["ref"]) == image["id"]:
                docker(image["docker_host"], ["image", "rm", image["ref"]])
        except Failure as e:
            problems.append(str(e))
    d = Path(record["dir"])
    if d.exists():
        shutil.rmtree(d, onerror=lambda _f, p, e: problems.append(f"cannot remove {p}: {e[1]}"))
    if not problems:
        registry = registry_dir(state_dir) / f"{record['key']}.json"
        registry.unlink(missing_ok=True)
        (registry_dir(state_dir) / f"{record['key']}.log").unlink(missing_ok=True)
    return problems


def is_holder(pid: int) -> bool:
    """Whether `pid` is a holder (a forked `setup`), not a process that reused its pid."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.endswith(b"fake_gpu_host.py") for arg in cmdline) and b"setup" in cmdline


def start_holder(lock_fd: int, record: dict, state_dir: Path, owner_pid: int) -> int:
    """Forks the process that keeps the lock (the same open file: the lock stays held while it
    lives) and tears the fake host down if the owner dies first. Returns its pid."""
    owner = os.pidfd_open(owner_pid) if owner_pid > 0 else None
    log = registry_dir(state_dir) / f"{record['key']}.log"
    pid = os.fork()
    if pid:
        if owner is not None:
            os.close(owner)
        return pid
    try:
        os.setsid()
        os.chdir("/")
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        keep = {0, 1, 2, lock_fd} | ({owner} if owner is not None else set())
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the directory's own descriptor, already closed
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if owner is None:
            while True:
                signal.pause()
        select.select([owner], [], [])
        say(f"the owner (pid {owner_pid}) exited without a teardown: tearing down {record['dir']}")
        for problem in remove_host(record, state_dir):
            say(f"  {problem}")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 (a forked child must never return)
        try:
            say(f"holder: {e!r}")
        finally:
            os._exit(1)


# ------------------------------------------------------------------------------- commands


def cmd_setup(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise Failure("setup needs root (mknod, the CDI directory, the lock)")
    d = Path(os.path.abspath(args.dir))
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise Failure(f"--dir {d}: not a new or empty directory")
    n = args.gpus
    if not 1 <= n <= MAX_GPUS:
        raise Failure(f"--gpus {n}: from 1 to {MAX_GPUS}")
    vendor = args.vendor
    kinds = cdi_kinds(args.cdi_names, vendor)
    if vendor != "nvidia" and args.topology not in (None, "plain"):
        raise Failure("--topology is NVIDIA's (nvidia-smi topo -m)")
    topology = args.topology or "plain"
    topo = topology_text(topology, n) if vendor == "nvidia" else None
    docker_host = args.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    state_dir = Path(args.state_dir)
    record = plan(d, vendor, n)
    spec_path: Optional[Path] = None
    if kinds:
        suffix = ".yaml" if vendor == "nvidia" else ".json"
        name = args.spec_name or f"dstack-shim-fake-{record['key']}"
        if "/" in name:
            raise Failure(f"--spec-name {name}: a file name, not a path")
        if not name.endswith((".yaml", ".json")):
            name += suffix
        spec_path = Path(args.cdi_dir) / name
    record["cdi"] = {
        "spec": str(spec_path) if spec_path else None,
        "kind": {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}.get(vendor),
        "names": kinds,
    }
    for g in record["gpus"]:
        g["cdi_devices"] = [
            f"{record['cdi']['kind']}={name}" for name in cdi_device_names(kinds, g)
        ]
    record["cdi"]["all"] = f"{record['cdi']['kind']}=all" if kinds else None
    record["topology"] = topology if vendor == "nvidia" else None
    record["docker_host"] = docker_host
    record["images"] = []
    record["bin"] = str(d / "bin")

    lock_fd = take_lock(state_dir, args.lock_timeout, d)
    try:
        reap_stale(state_dir)
        if spec_path is not None and spec_path.exists():
            raise Failure(f"{spec_path} exists (another tool's spec?): choose --spec-name")
    except BaseException:
        os.close(lock_fd)
        raise
    try:
        d.mkdir(parents=True, exist_ok=True)
        register(state_dir, record)  # from now on a killed setup is cleaned up by the next
        build(d, record, topo, spec_path)
        if args.host_nodes:
            if vendor == "nvidia":
                raise Failure("--host-nodes: NVIDIA goes through CDI or a device request")
            make_host_nodes(record)
            register(state_dir, record)
        key = record["key"]
        if vendor == "amd":
            files = {"usr/bin/amd-smi": (AMD_SMI_SCRIPT.encode(), 0o755)}
            for name, text in amd_smi_outputs(record).items():
                files[f"usr/share/fake-amd-smi/{name}"] = (text.encode(), 0o644)
            record["images"].append(
                import_image(docker_host, AMD_SMI_IMAGE, key, "/usr/bin/amd-smi", files)
            )
            register(state_dir, record)
        elif vendor == "tenstorrent":
            files = {
                "usr/bin/tt-smi": (TT_SMI_SCRIPT.encode(), 0o755),
                "usr/share/fake-tt-smi/snapshot.json": (tt_smi_snapshot(record).encode(), 0o644),
            }
            record["images"].append(
                import_image(docker_host, TT_SMI_IMAGE, key, "/usr/bin/tt-smi", files)
            )
            register(state_dir, record)
        record["owner_pid"] = args.owner_pid if args.owner_pid is not None else os.getppid()
        record["holder_pid"] = start_holder(lock_fd, record, state_dir, record["owner_pid"])
        register(state_dir, record)
        write_atomic(d / "host.json", json.dumps(record, indent=2) + "\n")
    except BaseException:
        holder = record.get("holder_pid")
        if holder:
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)
        for problem in remove_host(record, state_dir):
            say(f"clean-up after the failed setup: {problem}")
        raise
    finally:
        os.close(lock_fd)  # the holder keeps the lock (same open file) once it runs
    print(json.dumps(record, indent=2))
    return 0


def cdi_kinds(text: Optional[str], vendor: str) -> list[str]:
    default = {"nvidia": "index,uuid", "amd": "index", "tenstorrent": "none"}[vendor]
    text = text or default
    if text == "none":
        return []
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    for k in kinds:
        if k not in CDI_NAME_KINDS:
            raise Failure(f"--cdi-names {text}: from {', '.join(CDI_NAME_KINDS)}, or none")
    if vendor == "amd" and kinds != ["index"]:
        raise Failure("--cdi-names: AMD's toolkit names devices by index only (index or none)")
    if vendor == "tenstorrent":
        raise Failure("--cdi-names: no CDI generator is known for Tenstorrent (none only)")
    return list(dict.fromkeys(kinds))


def build(d: Path, record: dict, topo: Optional[str], spec_path: Optional[Path]) -> None:
    """Everything in D, then the spec."""
    os.chmod(d, 0o755)
    make_nodes(d, record)
    (d / "bin").mkdir()
    (d / "lib").mkdir()
    (d / "data").mkdir()
    shutil.copy2(__file__, d / "lib/fake_gpu_host.py")
    python = os.path.realpath(sys.executable)

    def launcher(tool: str, main: str) -> str:
        return (
            f"#!{python} -I\n"
            f"# {tool} of the fake GPU host {d} (dstack-shim tests/gpu-host/fake_gpu_host.py)\n"
            "import sys\n"
            f"sys.path.insert(0, {str(d / 'lib')!r})\n"
            "import fake_gpu_host\n"
            f"sys.exit(fake_gpu_host.{main}(fake_gpu_host.Path({str(d)!r}), sys.argv[1:]))\n"
        )

    write_atomic(d / "bin/docker", launcher("docker CLI wrapper", "docker_main"), 0o755)
    if record["vendor"] == "nvidia":
        write_atomic(d / "bin/nvidia-smi", launcher("nvidia-smi", "nvidia_smi_main"), 0o755)
        (d / "container").mkdir()
        write_atomic(d / "container/nvidia-smi", container_smi(record), 0o755)
        shutil.copyfile(NVIDIA_QUERY_RECORDING, d / "data/nvidia-smi-q.txt")
        if topo is not None:
            write_atomic(d / "data/topo.txt", topo)
        write_atomic(d / "state.json", json.dumps({"health": {}}, indent=2) + "\n")
    if spec_path is not None:
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        if record["vendor"] == "nvidia":
            text = to_yaml(nvidia_spec(record, record["cdi"]["names"], d))
        else:
            text = json.dumps(amd_spec(record, d), separators=(",", ":")) + "\n"
        write_atomic(spec_path, text)


def cmd_teardown(args: argparse.Namespace) -> int:
    d = Path(os.path.abspath(args.dir))
    state_dir = Path(args.state_dir)
    registered = registry_dir(state_dir) / f"{host_key(d)}.json"
    if registered.exists():
        record = read_json(registered)
    elif (d / "host.json").exists():
        record = load_record(d)
    else:
        say(f"nothing to tear down at {d}")
        return 0
    problems = remove_host(record, state_dir)
    holder = record.get("holder_pid")
    if holder and is_holder(holder):
        try:
            pidfd = os.pidfd_open(holder)
        except ProcessLookupError:
            pidfd = None
        if pidfd is not None:
            os.kill(holder, signal.SIGTERM)
            ready, _, _ = select.select([pidfd], [], [], 30)
            os.close(pidfd)
            if not ready:
                problems.append(f"the lock holder (pid {holder}) did not exit within 30 s")
    for problem in problems:
        say(problem)
    return 1 if problems else 0


def cmd_set_health(args: argparse.Namespace) -> int:
    d = Path(os.path.abspath(args.dir))
    record = load_record(d)
    if record["vendor"] != "nvidia":
        raise Failure("set-health: NVIDIA only (nvidia-smi -q)")
    if not 0 <= args.gpu < len(record["gpus"]):
        raise Failure(f"--gpu {args.gpu}: the fake host has {len(record['gpus'])} GPUs")
    for s in args.state:
        if s not in HEALTH_STATES:
            raise Failure(f"{s}: one of {', '.join(HEALTH_STATES)}")
    reasons = [s for s in dict.fromkeys(args.state) if s != "healthy"]
    state = {"health": read_health(d)}
    state["health"][str(args.gpu)] = reasons
    write_atomic(d / "state.json", json.dumps(state, indent=2) + "\n")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise Failure("exec: no command")
    d = Path(os.path.abspath(args.dir))
    record = load_record(d)
    enter(d, record)
    env = dict(os.environ)
    env["PATH"] = f"{d / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["DSTACK_FAKE_GPU_HOST"] = str(d)
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        raise Failure(f"cannot run {command[0]}: {e.strerror}") from None


def enter(d: Path, record: dict) -> None:
    """This process into a new mount namespace (a slave of the host's) whose /dev is a tmpfs
    with the host's /dev entries bound in and the fake nodes copied in at their real paths."""
    if os.geteuid() != 0:
        raise Failure("exec needs root (a mount namespace)")
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_SLAVE)
    fake_dev = d / "dev"
    fake = {entry.name for entry in os.scandir(fake_dev)}
    stage = d / ".host-dev"
    stage.mkdir(exist_ok=True)
    mount("/dev", stage, None, MS_BIND | MS_REC)
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "mode=0755,size=4m")
    for entry in os.scandir(stage):
        if entry.name in fake:
            continue  # the fake host's, e.g. its /dev/dri instead of the host's
        source, target = Path(entry.path), Path("/dev") / entry.name
        st = os.lstat(source)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(source), target)
        elif stat.S_ISDIR(st.st_mode):
            target.mkdir(mode=stat.S_IMODE(st.st_mode))
            mount(source, target, None, MS_BIND | MS_REC)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o600))
            mount(source, target, None, MS_BIND)
    copy_tree(fake_dev, Path("/dev"))
    umount_detach(stage)
    if record["vendor"] == "tenstorrent":
        # What the shim reads for the driver's version; the tmpfs hides the host's modules
        # from this namespace only.
        mount("tmpfs", "/sys/module", "tmpfs", MS_NOSUID, "mode=0755,size=64k")
        Path("/sys/module/tenstorrent").mkdir()
        Path("/sys/module/tenstorrent/version").write_text(record["driver_version"] + "\n")


def copy_tree(source: Path, target: Path) -> None:
    """Copies directories, symbolic links and device nodes (made anew with the same numbers, so
    that they work whatever the mount options of D's file system)."""
    for entry in os.scandir(source):
        src, dst = Path(entry.path), target / entry.name
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISDIR(st.st_mode):
            dst.mkdir(mode=stat.S_IMODE(st.st_mode))
            copy_tree(src, dst)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            os.mknod(dst, st.st_mode, st.st_rdev)
            os.chmod(dst, stat.S_IMODE(st.st_mode))


def docker_main(d: Path, argv: list[str]) -> int:
    """The `docker` of the fake host's PATH: the real CLI, with each `--device` of `run` and
    `create` whose host path is a fake node's (`/dev/kfd`, `/dev/dri`, `/dev/tenstorrent`, ...)
    pointed at that node under D (the engine looks host paths up outside the namespace)."""
    own = os.path.realpath(d / "bin")
    real = None
    for entry in os.environ.get("PATH", "").split(":"):
        if entry and os.path.realpath(entry) != own:
            candidate = os.path.join(entry, "docker")
            if os.access(candidate, os.X_OK) and os.path.isfile(candidate):
                real = candidate
                break
    if real is None:
        sys.stderr.write("fake-gpu-host docker wrapper: no docker CLI in PATH\n")
        return 127
    subcommand = next((a for a in argv if not a.startswith("-")), None)
    if subcommand in ("run", "create"):
        argv = rewrite_devices(d, argv)
    os.execv(real, [real, *argv])
    return 127


def rewrite_devices(d: Path, argv: list[str]) -> list[str]:
    def fake(value: str) -> str:
        host, sep, rest = value.partition(":")
        if host.startswith("/dev/") and os.path.lexists(d / host[1:]):
            container = rest if sep else host
            return f"{d / host[1:]}:{container}"
        return value

    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--device":
            out.append(arg)
            value = next(it, None)
            if value is not None:
                out.append(fake(value))
        elif arg.startswith("--device="):
            out.append("--device=" + fake(arg.split("=", 1)[1]))
        else:
            out.append(arg)
    return out


# ----------------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fake_gpu_host.py",
        description="A fake GPU host for dstack-shim's tests: device nodes, vendor tools, a CDI "
        "spec, and a mount namespace that shows them (see the module's docstring).",
    )
    sub = parser.add_subparsers(dest="command_name", required=True)

    p = sub.add_parser("setup", help="make the fake host in --dir")
    p.add_argument("--dir", required=True, help="a new or empty directory for the fake host")
    p.add_argument("--vendor", required=True, choices=VENDORS)
    p.add_argument("--gpus", required=True, type=int, help=f"how many GPUs (1 to {MAX_GPUS})")
    p.add_argument("--cdi-dir", default=str(DEFAULT_CDI_DIR),
                   help="where the engine reads CDI specs (default /var/run/cdi: every engine "
                   "here reads it; /etc/cdi is each engine root's own)")
    p.add_argument("--cdi-names", help="the CDI device names: a comma-separated list of index "
                   "(nvidia.com/gpu=0), uuid (=GPU-...), legacy (=gpu0), or none (no spec: a host "
                   "without CDI); `all` comes with any (default: NVIDIA index,uuid as nvidia-ctk "
                   ">= 1.18; AMD index; Tenstorrent none)")
    p.add_argument("--topology", help="NVIDIA: nvidia-smi topo -m prints the recorded matrix "
                   "of this name (crates/shim-resources/testdata/gpu/topo; its GPU count must be "
                   "--gpus), `plain` (default: every pair NODE on one NUMA node), or `none` (the "
                   "command fails)")
    p.add_argument("--spec-name", help="the spec's file name (default dstack-shim-fake-<key>)")
    p.add_argument("--host-nodes", action="store_true",
                   help="AMD, Tenstorrent: also make the nodes at their real paths on the host "
                   "(what a plain device mapping needs; any GPU-detecting shim then sees them: "
                   "run alone), removed at the teardown")
    p.add_argument("--docker-host", help="the engine the AMD and Tenstorrent tool images go to "
                   "(default $DOCKER_HOST, else unix:///var/run/docker.sock)")
    p.add_argument("--owner-pid", type=int, help="tear the host down when this process exits "
                   "(default: the parent of this command; 0: never, only teardown)")
    p.add_argument("--lock-timeout", type=float, default=600,
                   help="seconds to wait for another fake host's teardown (default 600)")
    p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR),
                   help="where the lock and the records of live hosts are "
                   "(default /var/lib/dstack-shim-dev)")

    p = sub.add_parser("exec", help="run a command that sees the fake host")
    p.add_argument("--dir", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER, help="[--] CMD [ARGS..]")

    p = sub.add_parser("set-health", help="NVIDIA: what nvidia-smi -q reports for a GPU")
    p.add_argument("--dir", required=True)
    p.add_argument("--gpu", required=True, type=int, help="its index")
    p.add_argument("state", nargs="+", help=" | ".join(HEALTH_STATES))

    p = sub.add_parser("teardown", help="remove everything setup made")
    p.add_argument("--dir", required=True)
    p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    handlers = {
        "setup": cmd_setup,
        "exec": cmd_exec,
        "set-health": cmd_set_health,
        "teardown": cmd_teardown,
    }
    try:
        return handlers[args.command_name](args)
    except Failure as e:
        say(f"error: {e}")
        return 1
    except OSError as e:
        say(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
