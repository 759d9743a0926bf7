#!/usr/bin/env python3
"""
Runs the dstack server's own shim-facing decision code against a running shim.

It imports the installed `dstack` package (tested with dstack==0.22.5) and calls, unchanged:

* `ShimClient` (dstack/_internal/server/services/runner/client.py): API negotiation and every
  version gate (API v2, instance health, instance info, components, shutdown, restart-safe
  running tasks), plus the read-only endpoints the instance check uses;
* `_maybe_install_components` and `_check_instance_inner` (the function under the
  `@runner_ssh_tunnel` decorator, called through `__wrapped__`) from
  dstack/_internal/server/background/pipeline_tasks/instances/check.py: the periodic instance
  check, which may ask the shim to install the runner or the shim (`POST /api/components/install`)
  and to restart (`POST /api/shutdown`).

What is mocked, and only that:

* the SSH tunnel: the shim is reached directly at the URL given;
* the DB: a transient `InstanceModel` (no session, no jobs) stands for the instance;
* the server settings that select the expected component versions
  (`dstack._internal.settings.DSTACK_VERSION` and friends), to simulate a release server and
  a dev server (no version) in one process;
* mutating requests: `POST /api/components/install`, `POST /api/shutdown` and
  `POST /api/tasks/<id>/{terminate,remove}` are recorded and answered `200` locally instead of
  being sent, so the check never changes the shim. They are the decisions under test.

Exit status: 0 when every assertion holds, 1 on a failed assertion, 2 on a usage or setup error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import platform
import re
import sys
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

try:
    import packaging.version
    import requests

    import dstack.version
    from dstack._internal import settings
    from dstack._internal.core.consts import DSTACK_SHIM_HTTP_PORT
    from dstack._internal.server.background.pipeline_tasks.instances import check
    from dstack._internal.server.models import InstanceModel
    from dstack._internal.server.schemas.runner import TaskStatus
    from dstack._internal.server.services.runner import client as runner_client
except ImportError as e:  # pragma: no cover - environment problem
    print(
        f"error: cannot import the dstack server package ({e}).\n"
        "Install it with: pip install 'dstack[server]==0.22.5' (see README.md)",
        file=sys.stderr,
    )
    sys.exit(2)

ShimClient = runner_client.ShimClient

DEFAULT_RELEASE_VERSION = "0.22.5"


# ---------------------------------------------------------------------------------------------
# Failures


class CheckFailed(Exception):
    pass


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)
    passes: int = 0

    def check(self, ok: bool, what: str, why: str = "") -> bool:
        if ok:
            self.passes += 1
            print(f"  ok    {what}")
        else:
            msg = f"{what}: {why}" if why else what
            self.failures.append(msg)
            print(f"  FAIL  {msg}")
        return ok


# ---------------------------------------------------------------------------------------------
# Interception of mutating requests


_INTERCEPTED = [
    ("POST", re.compile(r"^/?api/components/install$"), "install"),
    ("POST", re.compile(r"^/?api/shutdown$"), "shutdown"),
    ("POST", re.compile(r"^/?api/tasks/[^/]+/terminate$"), "terminate-task"),
    ("POST", re.compile(r"^/?api/tasks/[^/]+/remove$"), "remove-task"),
]


@dataclass
class Recorded:
    kind: str
    method: str
    path: str
    body: Optional[dict[str, Any]]

    def __str__(self) -> str:
        body = json.dumps(self.body, sort_keys=True) if self.body is not None else ""
        return f"{self.method} {self.path} {body}".rstrip()


@contextlib.contextmanager
def intercept_mutations() -> Iterator[list[Recorded]]:
    """
    Wraps `ShimClient._request`, the single choke point of all ShimClient HTTP calls: mutating
    requests are recorded and answered `200` with an empty body; the rest goes to the shim.
    """
    recorded: list[Recorded] = []
    original = ShimClient._request

    def _request(self, method, path, body=None, *, raise_for_status=False):
        for m, pattern, kind in _INTERCEPTED:
            if method.upper() == m and pattern.match(path):
                recorded.append(
                    Recorded(
                        kind=kind,
                        method=method.upper(),
                        path="/" + path.lstrip("/"),
                        body=body.model_dump() if body is not None else None,
                    )
                )
                resp = requests.Response()
                resp.status_code = 200
                resp._content = b""
                resp.url = f"{self._base_url}/{path.lstrip('/')}"
                resp.request = requests.Request(method, resp.url).prepare()
                return resp
        return original(self, method, path, body, raise_for_status=raise_for_status)

    ShimClient._request = _request
    try:
        yield recorded
    finally:
        ShimClient._request = original


# ---------------------------------------------------------------------------------------------
# Server settings (which versions the server expects)


_VERSION_SETTINGS = {
    "DSTACK_VERSION": None,
    "DSTACK_RUNNER_VERSION": None,
    "DSTACK_RUNNER_VERSION_URL": None,
    "DSTACK_SHIM_VERSION": None,
    "DSTACK_SHIM_VERSION_URL": None,
    "DSTACK_SHIM_DOWNLOAD_URL": None,
    "DSTACK_USE_LATEST_FROM_BRANCH": False,  # would query GitHub
    "DSTACK_RUNNER_ALLOW_DOWNGRADE": False,
    "DSTACK_SHIM_ALLOW_DOWNGRADE": False,
}


@contextlib.contextmanager
def server_settings(
    server_version: Optional[str],
    allow_downgrade: bool = False,
    shim_download_url: Optional[str] = None,
) -> Iterator[None]:
    """
    Simulates a server started with `DSTACK_VERSION=<server_version>` (a release build), or
    a dev build (`server_version=None`: `version.__version__ == "0.0.0"` makes
    `settings.DSTACK_VERSION` None), with no DSTACK_{SHIM,RUNNER}_VERSION[_URL] overrides and
    `DSTACK_SHIM_DOWNLOAD_URL=<shim_download_url>` when given.
    """
    values = dict(_VERSION_SETTINGS)
    values["DSTACK_VERSION"] = server_version
    values["DSTACK_SHIM_DOWNLOAD_URL"] = shim_download_url
    values["DSTACK_RUNNER_ALLOW_DOWNGRADE"] = allow_downgrade
    values["DSTACK_SHIM_ALLOW_DOWNGRADE"] = allow_downgrade
    saved = {}
    for name, value in values.items():
        saved[name] = getattr(settings, name, None)
        setattr(settings, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(settings, name, value)


# ---------------------------------------------------------------------------------------------
# Log capture: the server logs its reasons at DEBUG


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # pragma: no cover
            self.lines.append(f"{record.levelname.lower()}: {record.msg!r}")


@contextlib.contextmanager
def capture_server_logs() -> Iterator[_ListHandler]:
    handler = _ListHandler()
    logger = logging.getLogger("dstack")
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


# ---------------------------------------------------------------------------------------------
# Shim address


@dataclass
class ShimAddress:
    url: str
    hostname: Optional[str] = None
    port: Optional[int] = None
    uds: Optional[Path] = None

    @classmethod
    def parse(cls, url: str) -> "ShimAddress":
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme == "unix":
            path = parsed.path or parsed.netloc
            if not path:
                raise ValueError(f"no socket path in {url!r}")
            return cls(url=url, uds=Path(path))
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"expected http://HOST:PORT or unix:///PATH, got {url!r}")
        return cls(url=url, hostname=parsed.hostname, port=parsed.port)

    def client(self) -> ShimClient:
        if self.uds is not None:
            return ShimClient(uds=self.uds)
        return ShimClient(port=self.port, hostname=self.hostname)

    @contextlib.contextmanager
    def tunnel_addresses(self) -> Iterator[dict[int, runner_client.LocalAddress]]:
        """
        What `@runner_ssh_tunnel` hands to the wrapped function: local addresses keyed by the
        remote port. `ShimClient.from_address()` always connects to `localhost`; for another
        host it is redirected to the URL's host (the one extra mock this needs).
        """
        if self.uds is not None:
            yield {DSTACK_SHIM_HTTP_PORT: self.uds}
            return
        if self.hostname in ("localhost", "127.0.0.1"):
            yield {DSTACK_SHIM_HTTP_PORT: self.port}
            return
        original = ShimClient.__dict__["from_address"]
        hostname = self.hostname

        def from_address(cls, address):
            if isinstance(address, int):
                return cls(port=address, hostname=hostname)
            return cls(uds=address)

        ShimClient.from_address = classmethod(from_address)
        try:
            yield {DSTACK_SHIM_HTTP_PORT: self.port}
        finally:
            ShimClient.from_address = original


def make_instance(name: str) -> InstanceModel:
    # Transient ORM object: never added to a session. No jobs are assigned to it, so any shim
    # task would be "dangling" for `remove_dangling_tasks_from_instance` (intercepted).
    return InstanceModel(id=uuid.uuid4(), name=name, jobs=[], job_provisioning_data=None)


# ---------------------------------------------------------------------------------------------
# (i) API negotiation and feature gates


GATES = [
    ("API v2 (/api/tasks)", "is_api_v2_supported", "_API_V2_MIN_SHIM_VERSION"),
    ("instance health (/api/instance/health)", "is_instance_health_supported",
     "_INSTANCE_HEALTH_MIN_SHIM_VERSION"),
    ("instance info (/api/instance/info)", "is_instance_info_supported",
     "_INSTANCE_INFO_MIN_SHIM_VERSION"),
    ("components (/api/components)", "are_components_supported",
     "_COMPONENTS_MIN_SHIM_VERSION"),
    ("shutdown (/api/shutdown)", "is_shutdown_supported", "_SHUTDOWN_MIN_SHIM_VERSION"),
]


def _min_version(attr: str) -> str:
    value = getattr(ShimClient, attr, None)
    return ".".join(map(str, value)) if value else "?"


def check_gates(addr: ShimAddress, report: Report) -> dict[str, Any]:
    print("\n== (i) API negotiation and feature gates (ShimClient)")
    client = addr.client()
    try:
        hc = client.healthcheck(unmask_exceptions=True)
    except requests.RequestException as e:
        raise CheckFailed(f"shim is not reachable at {addr.url}: {e}") from e
    except runner_client.ShimError as e:
        raise CheckFailed(f"shim healthcheck failed: {e}") from e
    version_string = client.get_version_string()
    version_tuple = client.get_version_tuple()
    print(f"  healthcheck: service={hc.service!r} version={hc.version!r}")
    print(
        f"  negotiated: version_tuple={version_tuple!r}"
        f" ({'None = treated as latest' if version_tuple is None else 'release'})"
        f" api_version={client._api_version}"
    )
    instance_check = runner_client.healthcheck_response_to_instance_check(hc)
    report.check(
        instance_check.reachable,
        "healthcheck_response_to_instance_check(): reachable (service == 'dstack-shim')",
        f"service={hc.service!r}: {instance_check.message}",
    )
    for label, method, min_attr in GATES:
        ok = bool(getattr(client, method)())
        report.check(ok, f"{label} [>= {_min_version(min_attr)}]", f"{method}() is False")
    statuses = client._get_restart_safe_task_statuses()
    report.check(
        TaskStatus.RUNNING in statuses,
        "running tasks are restart-safe"
        f" [>= {_min_version('_RESTART_SAFE_RUNNING_STATUS_MIN_SHIM_VERSION')}]",
        f"restart-safe statuses are {[s.value for s in statuses]}",
    )
    # Any other *_MIN_SHIM_VERSION a future dstack adds is reported too.
    known = {g[2] for g in GATES} | {"_RESTART_SAFE_RUNNING_STATUS_MIN_SHIM_VERSION"}
    for attr in sorted(a for a in dir(ShimClient) if a.endswith("_MIN_SHIM_VERSION")):
        if attr in known:
            continue
        min_version = getattr(ShimClient, attr)
        ok = client._check_min_version(min_version)
        report.check(ok, f"{attr} [>= {_min_version(attr)}]", "gate is off")

    print("  -- read-only endpoints the server calls, parsed with the server's schemas")
    for label, call in [
        ("get_instance_health()", client.get_instance_health),
        ("get_instance_info()", client.get_instance_info),
        ("list_tasks()", client.list_tasks),
        ("is_safe_to_restart()", client.is_safe_to_restart),
    ]:
        try:
            result = call()
        except Exception as e:
            report.check(False, label, f"{e.__class__.__name__}: {e}")
            continue
        report.check(True, f"{label} -> {_short(result)}")
    try:
        components = client.get_components()
    except Exception as e:
        report.check(False, "get_components()", f"{e.__class__.__name__}: {e}")
        components = None
    else:
        report.check(components is not None, "get_components() answered", "returned None")
    info: dict[str, Any] = {"running_version": version_string, "components": {}}
    if components is not None:
        for c in components:
            print(f"  component: name={c.name!r} status={c.status.value!r} version={c.version!r}")
            info["components"][c.name] = c
        report.check(components.shim is not None, "components list has dstack-shim")
        report.check(components.runner is not None, "components list has dstack-runner")
    return info


def _short(value: Any) -> str:
    if value is None:
        return "None"
    if hasattr(value, "model_dump_json"):
        text = value.model_dump_json()
    else:
        text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


# ---------------------------------------------------------------------------------------------
# (ii) The instance check's component decision


def explain(info: dict[str, Any], server_version: Optional[str]) -> None:
    """Prints the primitive comparisons the decision is made of, for the failure message."""
    running = info["running_version"]
    shim = info["components"].get("dstack-shim")
    runner = info["components"].get("dstack-runner")
    expected = server_version
    print(f"  expected (get_dstack_{{shim,runner}}_version()): {expected!r}")
    for name, comp in (("dstack-shim", shim), ("dstack-runner", runner)):
        if comp is None:
            continue
        parsed = check._parse_pypa_version(comp.version) if comp.version else None
        relation = "n/a"
        if expected is not None and parsed is not None:
            exp = packaging.version.parse(expected)
            relation = "==" if parsed == exp else (">" if parsed > exp else "<")
        print(
            f"  {name}: installed={comp.version!r} status={comp.status.value}"
            f" pypa={str(parsed) if parsed is not None else None!r}"
            f" installed {relation} expected"
        )
    if shim is not None:
        print(
            f"  restart check: installed shim {shim.version!r} "
            f"{'==' if shim.version == running else '!='} running {running!r} (string equality)"
        )


@dataclass
class Expectation:
    """
    What the release server's instance check should decide: `keep` (no install, no restart),
    `install-shim` (one `POST /api/components/install` of dstack-shim from `url`, no restart:
    the server restarts the shim at a later check, once the new binary is installed), or
    `restart` (no install, one graceful `POST /api/shutdown`: the binary on disk is not the
    running one). A dev server always runs the `keep` scenario.
    """

    kind: str = "keep"
    url: Optional[str] = None


def run_decision(
    addr: ShimAddress,
    server_version: Optional[str],
    report: Report,
    info: dict[str, Any],
    verbose: bool,
    allow_downgrade: bool,
    expect: Expectation = Expectation(),
    shim_download_url: Optional[str] = None,
) -> None:
    label = f"release server {server_version}" if server_version else "dev server (no version)"
    if allow_downgrade:
        label += ", DSTACK_*_ALLOW_DOWNGRADE set"
    if shim_download_url:
        label += f", DSTACK_SHIM_DOWNLOAD_URL={shim_download_url}"
    label += f", expecting: {expect.kind}" + (f" from {expect.url}" if expect.url else "")
    print(f"\n== (ii) instance check component decision: {label}")
    with server_settings(server_version, allow_downgrade, shim_download_url):
        from dstack._internal.core.backends.base.compute import (
            get_dstack_runner_version,
            get_dstack_shim_version,
        )

        print(
            f"  server expects: shim={get_dstack_shim_version()!r}"
            f" runner={get_dstack_runner_version()!r}"
        )
        explain(info, server_version)

        # 1. `_maybe_install_components` directly, so its exceptions are not swallowed.
        client = addr.client()
        with intercept_mutations() as recorded, capture_server_logs() as logs:
            error: Optional[BaseException] = None
            try:
                check._maybe_install_components(make_instance("rust-shim-check"), client)
            except Exception as e:  # noqa: BLE001 - reported as a failure
                error = e
        _print_logs(logs.lines, verbose)
        report.check(
            error is None,
            "_maybe_install_components() ran without an exception",
            f"{error.__class__.__name__}: {error}" if error else "",
        )
        _assert_decision(report, recorded, "_maybe_install_components()", expect)

        # 2. The whole per-instance check as the server runs it, minus the SSH tunnel.
        with (
            addr.tunnel_addresses() as addresses,
            intercept_mutations() as recorded,
            capture_server_logs() as logs,
        ):
            instance_check = check._check_instance_inner.__wrapped__(
                addresses,
                instance=make_instance("rust-shim-check"),
                check_instance_health=True,
                check_instance_info=True,
            )
        _print_logs(logs.lines, verbose)
        report.check(
            instance_check.reachable,
            "_check_instance_inner(): InstanceCheck.reachable",
            f"message={instance_check.message!r}",
        )
        for r in recorded:
            if r.kind in ("terminate-task", "remove-task"):
                print(f"  note: the check would clean up a task not assigned to it: {r}")
        warnings = [line for line in logs.lines if line.startswith(("warning", "error"))]
        report.check(
            not any("error installing components" in w for w in warnings),
            "_check_instance_inner(): no 'error installing components' warning",
            "; ".join(warnings),
        )
        _assert_decision(report, recorded, "_check_instance_inner()", expect)


def _print_logs(lines: list[str], verbose: bool) -> None:
    for line in lines:
        if verbose or "install" in line or "restart" in line or line.startswith(
            ("warning", "error")
        ):
            print(f"    server log {line}")


def _assert_decision(
    report: Report, recorded: list[Recorded], where: str, expect: Expectation
) -> None:
    shutdowns = [r for r in recorded if r.kind == "shutdown"]
    for component in ("dstack-shim", "dstack-runner"):
        installs = [
            r for r in recorded if r.kind == "install" and (r.body or {}).get("name") == component
        ]
        if component == "dstack-shim" and expect.kind == "install-shim":
            urls = [(r.body or {}).get("url") for r in installs]
            report.check(
                urls == [expect.url],
                f"{where}: one POST /api/components/install of {component} from {expect.url}",
                "server requested " + ("; ".join(str(r) for r in installs) or "nothing"),
            )
            continue
        report.check(
            not installs,
            f"{where}: no POST /api/components/install of {component}",
            "server requested " + "; ".join(str(r) for r in installs),
        )
    others = [
        r
        for r in recorded
        if r.kind == "install" and (r.body or {}).get("name") not in ("dstack-shim", "dstack-runner")
    ]
    report.check(
        not others,
        f"{where}: no other POST /api/components/install",
        "server requested " + "; ".join(str(r) for r in others),
    )
    if expect.kind == "restart":
        report.check(
            [r.body for r in shutdowns] == [{"force": False}],
            f"{where}: one graceful POST /api/shutdown (restart)",
            "server requested " + ("; ".join(str(r) for r in shutdowns) or "nothing"),
        )
    else:
        report.check(
            not shutdowns,
            f"{where}: no POST /api/shutdown (restart)",
            "server requested " + "; ".join(str(r) for r in shutdowns),
        )


# ---------------------------------------------------------------------------------------------
# Optional: host_info.json and the SSH fleet shim.env


def check_host_info(path: Path, report: Report) -> None:
    from dstack._internal.core.backends.base.compute import normalize_arch
    from dstack._internal.server.services.ssh_fleets.provisioning import (
        host_info_to_instance_type,
    )
    from dstack._internal.utils.network import get_ip_from_network

    print(f"\n== host_info.json ({path}) through the server's SSH fleet code")
    try:
        host_info = json.loads(path.read_text())
        arch = normalize_arch(platform.machine())
        instance_type = host_info_to_instance_type(host_info, arch)
    except Exception as e:
        report.check(False, "host_info_to_instance_type()", f"{e.__class__.__name__}: {e}")
        return
    report.check(True, f"host_info_to_instance_type() -> {instance_type.resources.pretty_format()}")
    internal_ip = get_ip_from_network(None, host_info.get("addresses", []))
    report.check(
        internal_ip is not None,
        f"get_ip_from_network(None, addresses) -> {internal_ip!r}",
        "no IPv4 interface address (CIDR form) in 'addresses'",
    )


class _FakeChannelFile:
    def __init__(self, data: bytes = b"") -> None:
        self._data = data

    def read(self) -> bytes:
        return self._data


class _FakeSFTP:
    def __init__(self, files: dict[str, str]) -> None:
        self._files = files

    def get_channel(self):
        return None

    def putfo(self, fo: io.BytesIO, path: str) -> None:
        self._files[path] = fo.read().decode()

    def close(self) -> None:
        pass


class _FakeSSHClient:
    """Just enough of paramiko.SSHClient for `upload_envs()`."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        self.commands: list[str] = []

    def open_sftp(self) -> _FakeSFTP:
        return _FakeSFTP(self.files)

    def exec_command(self, cmd: str, timeout: Optional[float] = None):
        self.commands.append(cmd)
        return None, _FakeChannelFile(), _FakeChannelFile()


def print_shim_env(server_version: Optional[str]) -> None:
    """Prints the shim.env the server uploads to an SSH fleet host, made by its own code."""
    from dstack._internal.core.backends.base.compute import get_dstack_working_dir, get_shim_env
    from dstack._internal.server.services.ssh_fleets.provisioning import upload_envs

    with server_settings(server_version):
        envs = get_shim_env(arch=platform.machine())
        fake = _FakeSSHClient()
        upload_envs(fake, get_dstack_working_dir(), envs)
    for path, text in fake.files.items():
        print(f"# {path} (moved to {get_dstack_working_dir()}/shim.env)")
        print(text)


# ---------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=(
            "Run the dstack server's own ShimClient gating and instance-check component "
            "decision against a running shim; fail if it would install or restart."
        )
    )
    parser.add_argument(
        "url", nargs="?", help="shim base URL: http://127.0.0.1:PORT or unix:///path/to/socket"
    )
    parser.add_argument(
        "--server-version",
        default=DEFAULT_RELEASE_VERSION,
        help=f"release server version to simulate (default {DEFAULT_RELEASE_VERSION})",
    )
    parser.add_argument(
        "--no-dev",
        action="store_true",
        help="skip the dev-server scenario (server without a version)",
    )
    parser.add_argument(
        "--allow-downgrade",
        action="store_true",
        help="also simulate DSTACK_SHIM_ALLOW_DOWNGRADE/DSTACK_RUNNER_ALLOW_DOWNGRADE "
        "(informational: reported, not counted as failures)",
    )
    parser.add_argument(
        "--shim-download-url",
        help="the server's DSTACK_SHIM_DOWNLOAD_URL template ({version}, {arch}) in the release "
        "server scenario",
    )
    parser.add_argument(
        "--expect",
        choices=["keep", "install-shim", "restart"],
        default="keep",
        help="what the release server scenario must decide (default keep: no install, no "
        "restart; install-shim needs --expect-url and --no-dev)",
    )
    parser.add_argument(
        "--expect-url", help="with --expect install-shim: the URL the server must install from"
    )
    parser.add_argument("--host-info", type=Path, help="also check this host_info.json")
    parser.add_argument(
        "--print-shim-env",
        action="store_true",
        help="print the shim.env the server writes on SSH fleet hosts and exit",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print all server logs")
    args = parser.parse_args(argv)

    if args.server_version.lower() in ("", "none", "dev"):
        parser.error("--server-version must be a release version; the dev scenario always runs")
    try:
        packaging.version.Version(args.server_version)
    except packaging.version.InvalidVersion:
        parser.error(f"--server-version {args.server_version!r} is not a PyPA version")

    if args.expect != "keep" and not args.no_dev:
        parser.error(f"--expect {args.expect} is about the release server: add --no-dev")
    if (args.expect == "install-shim") != (args.expect_url is not None):
        parser.error("--expect-url goes with --expect install-shim, and only with it")
    expect = Expectation(kind=args.expect, url=args.expect_url)

    if args.print_shim_env:
        print_shim_env(args.server_version)
        return 0
    if not args.url:
        parser.error("the shim URL is required")
    try:
        addr = ShimAddress.parse(args.url)
    except ValueError as e:
        parser.error(str(e))

    print(f"dstack package {dstack.version.__version__} (server code under test)")
    print(f"shim at {addr.url}")
    report = Report()
    try:
        info = check_gates(addr, report)
        scenarios: list[Optional[str]] = [args.server_version]
        if not args.no_dev:
            scenarios.append(None)
        for version in scenarios:
            run_decision(
                addr,
                version,
                report,
                info,
                args.verbose,
                allow_downgrade=False,
                expect=expect if version is not None else Expectation(),
                shim_download_url=args.shim_download_url if version is not None else None,
            )
        if args.allow_downgrade:
            info_report = Report()
            for version in scenarios:
                run_decision(addr, version, info_report, info, args.verbose, allow_downgrade=True)
            print(
                f"  (allow-downgrade scenarios are informational:"
                f" {len(info_report.failures)} would-fail item(s))"
            )
        if args.host_info is not None:
            check_host_info(args.host_info, report)
    except CheckFailed as e:
        report.failures.append(str(e))
        print(f"  FAIL  {e}")

    print()
    if report.failures:
        print(f"FAILED: {len(report.failures)} of {report.passes + len(report.failures)} checks")
        for f in report.failures:
            print(f"  - {f}")
        print(f"{report.passes} passed, {len(report.failures)} failed")
        return 1
    decision = {
        "keep": "requests no install and no restart",
        "install-shim": f"requests the install of dstack-shim from {args.expect_url} only",
        "restart": "requests a restart of the shim and no install",
    }[args.expect]
    print(
        f"OK: the dstack {dstack.version.__version__} server negotiates the newest shim API and, "
        f"as release {args.server_version}"
        + ("" if args.no_dev else " and as a dev build")
        + f", {decision}"
    )
    print(f"{report.passes} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
