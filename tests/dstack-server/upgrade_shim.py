#!/usr/bin/env python3
"""
Lets the dstack server's own instance check upgrade a running shim, for real.

It imports the installed `dstack` package (tested with dstack==0.22.5) and runs, unchanged,
`_maybe_install_components` (dstack/_internal/server/background/pipeline_tasks/instances/
check.py) against the shim at the URL given, as a release server of `--server-version` whose
`DSTACK_SHIM_DOWNLOAD_URL` is `--download-url` (`{version}`, `{arch}`), once per
`--interval` like the server's periodic check, until the shim's healthcheck answers the
server's version. Nothing is mocked but the SSH tunnel and the DB (see check_shim.py): the
install (`POST /api/components/install`) and the restart (`POST /api/shutdown`) are the
server's own requests, sent to the shim.

It prints one JSON object on its last line: the server's requests that change the shim, in
order, the number of checks, and the version that answered. Exit status: 0 when the server
installed the shim, asked for the restart and its version answers; 1 otherwise; 2 on a usage
or setup error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_shim  # noqa: E402  (the shared helpers and the dstack imports)
from check_shim import ShimAddress, ShimClient, check, make_instance, server_settings  # noqa: E402

import requests  # noqa: E402

MUTATING = ("POST",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("url", help="the shim, http://HOST:PORT")
    parser.add_argument("--server-version", default=check_shim.DEFAULT_RELEASE_VERSION)
    parser.add_argument("--download-url", required=True, help="DSTACK_SHIM_DOWNLOAD_URL")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        addr = ShimAddress.parse(args.url)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    sent: list[dict[str, Any]] = []
    original = ShimClient._request

    def _request(self, method, path, body=None, *, raise_for_status=False):
        if method.upper() in MUTATING:
            sent.append(
                {
                    "method": method.upper(),
                    "path": "/" + path.lstrip("/"),
                    "body": body.model_dump() if body is not None else None,
                }
            )
        return original(self, method, path, body, raise_for_status=raise_for_status)

    ShimClient._request = _request
    checks = 0
    answered = None
    deadline = time.monotonic() + args.timeout
    try:
        with server_settings(args.server_version, shim_download_url=args.download_url):
            while time.monotonic() < deadline:
                checks += 1
                try:
                    # A new client per check, as the server makes one per tunnel.
                    check._maybe_install_components(make_instance("rust-shim-upgrade"), addr.client())
                except requests.RequestException as e:
                    # The server logs a warning and tries again at its next check.
                    print(f"check {checks}: {e}", file=sys.stderr)
                try:
                    answered = addr.client().get_version_string()
                except requests.RequestException as e:
                    print(f"healthcheck: {e}", file=sys.stderr)
                    answered = None
                if answered is not None and answered.split("+")[0] == args.server_version:
                    break
                time.sleep(args.interval)
    finally:
        ShimClient._request = original

    installed = any(
        r["path"] == "/api/components/install" and (r["body"] or {}).get("name") == "dstack-shim"
        for r in sent
    )
    restarted = any(r["path"] == "/api/shutdown" for r in sent)
    print(json.dumps({"sent": sent, "checks": checks, "version": answered}))
    ok = installed and restarted and answered is not None and (
        answered.split("+")[0] == args.server_version
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
