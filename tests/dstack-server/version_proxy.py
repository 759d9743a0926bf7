#!/usr/bin/env python3
"""
A loopback HTTP proxy in front of a running shim that rewrites the version strings it reports:
`version` in `GET /api/healthcheck` and the `dstack-shim` component's `version` in
`GET /api/components` (optionally the `dstack-runner` one too). Everything else is passed
through unchanged, and mutating requests are refused (409) so that nothing is ever installed
or shut down through it.

It lets `check_shim.py` try a version scheme before the shim itself is changed:

    python version_proxy.py --upstream http://127.0.0.1:18998 --listen-port 18999 \
        --version 0.22.5+rust.0.1.0 &
    python check_shim.py http://127.0.0.1:18999

Standard library only. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(upstream: str, version: str, runner_version: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _forward(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length) if length else None
            req = urllib.request.Request(upstream + self.path, data=data, method=method)
            if self.headers.get("Content-Type"):
                req.add_header("Content-Type", self.headers["Content-Type"])
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    status, body = resp.status, resp.read()
                    ctype = resp.headers.get("Content-Type", "application/json")
            except urllib.error.HTTPError as e:
                status, body = e.code, e.read()
                ctype = e.headers.get("Content-Type", "text/plain")
            path = self.path.split("?", 1)[0]
            if status == 200 and path == "/api/healthcheck":
                doc = json.loads(body)
                doc["version"] = version
                body = json.dumps(doc).encode()
            elif status == 200 and path == "/api/components":
                doc = json.loads(body)
                for c in doc.get("components", []):
                    if c.get("name") == "dstack-shim" and c.get("status") == "installed":
                        c["version"] = version
                    if (
                        runner_version is not None
                        and c.get("name") == "dstack-runner"
                        and c.get("status") == "installed"
                    ):
                        c["version"] = runner_version
                body = json.dumps(doc).encode()
            self._send(status, body, ctype)

        def do_GET(self):
            self._forward("GET")

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if path in ("/api/components/install", "/api/shutdown") or path.endswith(
                ("/terminate", "/remove")
            ):
                self._send(409, b'{"error":"refused by version_proxy"}')
                return
            self._forward("POST")

    return Handler


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="the real shim, e.g. http://127.0.0.1:18998")
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--version", required=True, help="the version string to report")
    p.add_argument("--runner-version", help="also rewrite the dstack-runner component version")
    args = p.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.listen_port),
        make_handler(args.upstream.rstrip("/"), args.version, args.runner_version),
    )
    print(f"version_proxy: 127.0.0.1:{args.listen_port} -> {args.upstream} as {args.version!r}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
