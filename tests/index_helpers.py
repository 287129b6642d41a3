"""Shared helpers of the download tests (test_download.py, test_fetch.py): fake data wheels and
a fake package index (PEP 503 HTML or PEP 691 JSON) served over HTTP on 127.0.0.1.

The server answers on loopback only, in a daemon thread, and stops by itself after
`lifetime_s` if a test never stops it. Not a test module: imported as `from index_helpers
import ...` (tests/ is on sys.path, as for conftest).
"""

from __future__ import annotations

import hashlib
import json
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def make_wheel(folder: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A `py3-none-any` wheel of `package==version` holding `payload` as `member`."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = package.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(member, payload)
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FakeIndex:
    """What the server serves: `projects[name] = {filename: bytes}` (name PEP 503 normalized)."""

    projects: dict[str, dict[str, bytes]] = field(default_factory=dict)
    json: bool = True  # False: HTML pages only, whatever the Accept header asks
    ranges: bool = True  # False: Range headers are ignored (200 and the whole file)
    wrong_sha: bool = False  # the index lists a wrong SHA-256 for every file
    drop_after: Optional[int] = None  # cut file responses after this many bytes...
    drops: int = 0  # ...this many times (then serve whole)
    log: list[tuple[str, dict[str, str], int]] = field(default_factory=list)

    def add(self, package: str, wheel: Path) -> None:
        name = package.lower().replace("_", "-").replace(".", "-")
        self.projects.setdefault(name, {})[wheel.name] = wheel.read_bytes()

    def digest(self, data: bytes) -> str:
        return "0" * 64 if self.wrong_sha else sha256(data)

    def requests_for(self, suffix: str) -> list[tuple[str, dict[str, str], int]]:
        return [r for r in self.log if r[0].endswith(suffix)]


class _Handler(BaseHTTPRequestHandler):
    site: FakeIndex
    timeout = 10

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        site = self.site
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        headers = {k.lower(): v for k, v in self.headers.items()}
        if len(parts) == 2 and parts[0] == "simple" and parts[1] in site.projects:
            return self._page(site, parts[1], headers)
        if len(parts) == 3 and parts[0] == "files" and parts[1] in site.projects:
            data = site.projects[parts[1]].get(parts[2])
            if data is not None:
                return self._file(site, data, headers)
        self._respond(headers, 404, {}, b"")

    def _respond(
        self,
        request_headers: dict[str, str],
        status: int,
        headers: dict[str, str],
        body: bytes,
        cut: Optional[int] = None,
    ) -> None:
        """Log the request (before answering, so a client never sees the answer first), then
        send `body`, or only its first `cut` bytes and close."""
        self.site.log.append((self.path, request_headers, -status if cut is not None else status))
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body if cut is None else body[:cut])
        self.wfile.flush()
        self.close_connection = True

    def _page(self, site: FakeIndex, name: str, headers: dict[str, str]) -> None:
        files = site.projects[name]
        if site.json and JSON_TYPE in headers.get("accept", ""):
            body = json.dumps(
                {
                    "meta": {"api-version": "1.1"},
                    "name": name,
                    "files": [
                        {
                            "filename": f,
                            "url": f"../../files/{name}/{f}",
                            "hashes": {"sha256": site.digest(d)},
                            "size": len(d),
                        }
                        for f, d in files.items()
                    ],
                }
            ).encode()
            content_type = JSON_TYPE
        else:
            links = "".join(
                f'<a href="/files/{name}/{f}#sha256={site.digest(d)}">{f}</a><br/>\n'
                for f, d in files.items()
            )
            body = f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode()
            content_type = "text/html"
        self._respond(headers, 200, {"Content-Type": content_type}, body)

    def _file(self, site: FakeIndex, data: bytes, headers: dict[str, str]) -> None:
        start = 0
        wanted = headers.get("range", "")
        if site.ranges and wanted.startswith("bytes=") and wanted.endswith("-"):
            start = int(wanted[len("bytes=") : -1])
            if start >= len(data):
                return self._respond(headers, 416, {}, b"")
        reply = {"Content-Type": "application/octet-stream"}
        if start:
            reply["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = None
        if site.drop_after is not None and site.drops > 0:
            site.drops -= 1
            cut = site.drop_after
        self._respond(headers, 206 if start else 200, reply, data[start:], cut)


class IndexServer:
    """`FakeIndex` served on 127.0.0.1 (an ephemeral port) until `stop()` or `lifetime_s`."""

    def __init__(self, site: FakeIndex, lifetime_s: float = 120.0) -> None:
        handler = type("Handler", (_Handler,), {"site": site})
        self.site = site
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        self._stopped = False

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def index_url(self) -> str:
        return f"{self.url}/simple"

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._timer.cancel()
            self.httpd.shutdown()
            self.httpd.server_close()


PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def isolate_pip_config(monkeypatch, index_url: Optional[str] = None) -> None:
    """Nothing of this machine's pip/uv configuration (env, config files, find-links, proxies)
    reaches the code under test; `index_url` becomes PIP_INDEX_URL."""
    import os

    for var in ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL", *PROXY_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "10")
    if index_url is not None:
        monkeypatch.setenv("PIP_INDEX_URL", index_url)
