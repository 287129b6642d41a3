"""Wheels from a package index over plain HTTP (urllib), without pip.

`find_wheel` reads a project's page through the Simple Repository API (PEP 503 names; JSON
per PEP 691 preferred, HTML links otherwise) and picks the wheel of an exact version with the
index's SHA-256. `download` streams it to `<file>.partial`, resumes that with a `Range`
request on a later run or after a dropped connection (a server answering 200 instead of 206
gets a clean redo), checks the SHA-256 and renames it into place. TLS uses `index.ca_bundle()`
(PIP_CERT, ...), proxies come from the environment (urllib's `*_proxy`, `no_proxy`), the
socket timeout from `index.timeout()` (PIP_DEFAULT_TIMEOUT). Credentials in the index URL
(`https://user:token@host/...`) become a Basic `Authorization` header for that host.

Failures of the network or the index raise `DownloadError` (an `OSError`: the environment's
fault, exit code 1 from the CLIs); a file whose SHA-256 differs from the index's raises
`FormatError`. Both read as one line.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Optional, TextIO

from cellm import index
from cellm.errors import FormatError

ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html;q=0.1, text/html;q=0.01"
)
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
RETRIES = 2  # further tries after a dropped connection, each resuming where it stopped
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
_CHUNK = 1 << 20
_MIB = 1 << 20


class DownloadError(ConnectionError):
    """The index or the network failed (the environment's fault, not bad input)."""


@dataclass(frozen=True)
class WheelLink:
    filename: str
    url: str
    sha256: Optional[str]
    size: Optional[int]


class Session:
    """One opener for the index and its files: TLS from the configuration, proxies from the
    environment, the index URL's credentials for its host."""

    def __init__(self, timeout: Optional[float] = None) -> None:
        self.timeout = index.timeout() if timeout is None else timeout
        context = ssl.create_default_context()
        bundle = index.ca_bundle()
        if bundle and os.path.isdir(bundle):
            context.load_verify_locations(capath=bundle)
        elif bundle and os.path.isfile(bundle):
            context.load_verify_locations(cafile=bundle)
        self._opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
        self._auth: dict[str, str] = {}
        version = _version()
        self.user_agent = f"cellm/{version} (urllib)"

    def strip_auth(self, url: str) -> str:
        """`url` without credentials, remembered as the Authorization of its host."""
        parts = urllib.parse.urlsplit(url)
        if "@" not in parts.netloc:
            return url
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        self._auth[host.lower()] = "Basic " + base64.b64encode(token.encode()).decode()
        return urllib.parse.urlunsplit(parts._replace(netloc=host))

    def open(self, url: str, headers: Optional[dict[str, str]] = None) -> Any:
        """The response to a GET of `url` (urllib's; HTTPError for a status >= 400)."""
        request = urllib.request.Request(url, headers={"User-Agent": self.user_agent})
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        auth = self._auth.get(urllib.parse.urlsplit(url).netloc.lower())
        if auth:
            request.add_unredirected_header("Authorization", auth)
        return self._opener.open(request, timeout=self.timeout)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("cellm")
    except Exception:  # not installed as a distribution (a source tree on PYTHONPATH)
        return "0"


def project_url(index_url: str, package: str) -> str:
    """`<index>/<PEP 503 name>/`."""
    return f"{index_url.rstrip('/')}/{index.normalize_name(package)}/"


def project_files(session: Session, index_url: str, package: str) -> list[WheelLink]:
    """Every file the index lists for `package` (JSON or HTML page)."""
    url = project_url(session.strip_auth(index_url), package)
    shown = index.redact(project_url(index_url, package))
    body, content_type, final_url = _get_page(session, url, shown, package)
    if content_type.startswith(JSON_TYPE):
        try:
            return _json_files(json.loads(body), final_url)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DownloadError(f"{shown}: not a valid simple index page ({e})") from None
    parser = _Links(final_url)
    parser.feed(body.decode("utf-8", errors="replace"))
    return parser.files


def _get_page(session: Session, url: str, shown: str, package: str) -> tuple[bytes, str, str]:
    for attempt in range(RETRIES + 1):
        try:
            with session.open(url, {"Accept": ACCEPT}) as response:
                content_type = response.headers.get("Content-Type", "text/html")
                return response.read(), content_type.lower(), response.geturl()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise DownloadError(
                    f"{package} is not on the package index {shown} (HTTP 404); set "
                    "PIP_INDEX_URL to an index that has it"
                ) from None
            if e.code not in RETRY_STATUS or attempt == RETRIES:
                raise DownloadError(f"{shown}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if _fatal(e) or attempt == RETRIES:
                message = f"cannot reach the package index {shown}: {_reason(e)}"
                raise DownloadError(message) from None
        time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _json_files(page: dict[str, Any], base: str) -> list[WheelLink]:
    files = []
    for f in page["files"]:
        sha = (f.get("hashes") or {}).get("sha256")
        size = f.get("size")
        files.append(
            WheelLink(
                f["filename"],
                urllib.parse.urljoin(base, f["url"]),
                sha.lower() if isinstance(sha, str) else None,
                size if isinstance(size, int) else None,
            )
        )
    return files


class _Links(HTMLParser):
    """The `<a href>` links of a PEP 503 HTML page, hashes from `#sha256=` fragments."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.base = base
        self.files: list[WheelLink] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        if tag == "base":
            href = dict(attrs).get("href")
            if href:
                self.base = urllib.parse.urljoin(self.base, href)
        if tag != "a":
            return
        href = dict(attrs).get("href")
        if not href:
            return
        url, _, fragment = urllib.parse.urljoin(self.base, href).partition("#")
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        algo, _, value = fragment.partition("=")
        sha = value.lower() if algo == "sha256" and value else None
        self.files.append(WheelLink(name, url, sha, None))


def find_wheel(session: Session, index_url: str, package: str, version: str) -> WheelLink:
    """The wheel of exactly `package==version` on the index (`py3-none-any` preferred)."""
    files = project_files(session, index_url, package)
    wheels = [f for f in files if index.is_wheel_of(f.filename, package, version)]
    if not wheels:
        versions = sorted({_version_of(f.filename) for f in files if f.filename.endswith(".whl")})
        listed = ", ".join(versions) if versions else "no wheels"
        raise DownloadError(
            f"{package}=={version}: no such wheel on the package index "
            f"{index.redact(project_url(index_url, package))} (it lists {listed})"
        )
    wheels.sort(key=lambda f: (not f.filename.endswith("-py3-none-any.whl"), f.filename))
    return wheels[0]


def _version_of(filename: str) -> str:
    fields = filename.split("-")
    return fields[1] if len(fields) > 1 else "?"


class Reporter:
    """Progress of one file: a tqdm bar on a terminal, else one plain line
    (`cellm: downloading LABEL ... 78.2 MiB in 1.6 s`), or nothing."""

    def __init__(self, label: str, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._start = time.monotonic()
        self._opened = False
        self._resumed_at = 0
        self.done = 0
        if enabled and _isatty(self.stream):
            try:
                from tqdm import tqdm

                self._tqdm: Any = tqdm
            except ImportError:  # pragma: no cover - a dependency; plain lines without it
                self._tqdm = None
        else:
            self._tqdm = None

    def start(self, total: Optional[int], initial: int) -> None:
        """A transfer of `total` bytes begins at `initial` (a resumed `.partial`)."""
        self.done = initial
        if not self.enabled:
            return
        if self._tqdm is not None:
            if self._bar is None:
                self._bar = self._tqdm(
                    total=total,
                    initial=initial,
                    desc=self.label,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    file=self.stream,
                    mininterval=0.2,
                )
            else:
                self._bar.reset(total=total)
                self._bar.update(initial)
            return
        if not self._opened:
            self._opened = True
            self._resumed_at = initial
            resumed = f", resuming at {initial / _MIB:,.1f} MiB" if initial else ""
            self.stream.write(f"cellm: downloading {self.label}{resumed} ...")
            self.stream.flush()

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def note(self, message: str) -> None:
        """A retry or a restart, said in passing."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(f"cellm: {self.label}: {message}", file=self.stream)
        elif self._opened:
            self.stream.write(f" [{message}]")
            self.stream.flush()

    def close(self, ok: bool) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._opened:
            elapsed = time.monotonic() - self._start
            fetched = (self.done - self._resumed_at) / _MIB
            tail = f" {fetched:,.1f} MiB in {elapsed:.1f} s" if ok else " failed"
            self.stream.write(tail + "\n")
            self.stream.flush()
            self._opened = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Dropped(Exception):
    """A transfer broke off in a way that a retry (resuming) may mend."""


def download(
    session: Session,
    link: WheelLink,
    folder: Path,
    reporter: Optional[Reporter] = None,
    retries: int = RETRIES,
) -> Path:
    """`folder/<link.filename>`, complete and checked against the index's SHA-256.

    The bytes go to `<filename>.partial` first, which a later call (or a retry after a dropped
    connection) continues with a `Range` request; a server that answers 200 instead of 206
    gets a clean redo. A checksum mismatch deletes the partial file and raises FormatError."""
    reporter = reporter or Reporter(link.filename, enabled=False)
    final = folder / link.filename
    partial = folder / f"{link.filename}.partial"
    ok = False
    try:
        for attempt in range(retries + 1):
            try:
                _transfer(session, link, partial, reporter)
                break
            except _Dropped as e:
                if attempt == retries:
                    have = partial.stat().st_size if partial.exists() else 0
                    raise DownloadError(
                        f"{link.filename}: {e}; gave up after {attempt + 1} tries "
                        f"({have / _MIB:,.1f} MiB kept in {partial.name}, resumed next time)"
                    ) from None
                reporter.note(f"{e}; retrying")
                time.sleep(0.5 * (attempt + 1))
        _check(link, partial)
        os.replace(partial, final)
        ok = True
    finally:
        reporter.close(ok)
    return final


def _transfer(session: Session, link: WheelLink, partial: Path, reporter: Reporter) -> None:
    have = partial.stat().st_size if partial.exists() else 0
    if link.size is not None and have >= link.size:
        if have == link.size:
            reporter.start(link.size, have)
            return  # complete already (stopped before the rename): the checksum decides
        partial.unlink()  # longer than the file: not ours to continue
        have = 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        response = session.open(link.url, headers)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the range is past the end: start over
            partial.unlink()
            reporter.note("partial file not resumable; restarting")
            raise _Dropped("server refused to resume") from None
        if e.code in RETRY_STATUS:
            raise _Dropped(f"HTTP {e.code} {e.reason}") from None
        raise DownloadError(f"{index.redact(link.url)}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        if _fatal(e):
            raise DownloadError(f"cannot download {link.filename}: {_reason(e)}") from None
        raise _Dropped(_reason(e)) from None
    with response:
        resumed = bool(have) and response.status == 206 and _range_start(response) == have
        if response.status == 206 and not resumed:  # a range that is not ours: start over
            partial.unlink(missing_ok=True)
            raise _Dropped("server sent another range than asked for")
        if have and not resumed:
            reporter.note("server does not resume; starting over")
            have = 0
        length = response.headers.get("Content-Length")
        expected = link.size
        if expected is None and length is not None and length.isdigit():
            expected = have + int(length)
        reporter.start(expected, have)
        with open(partial, "ab" if have else "wb") as out:
            while True:
                try:
                    chunk = response.read(_CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise _Dropped(_reason(e)) from None
                if not chunk:
                    break
                out.write(chunk)  # an OSError here (disk full) is not a retry's to mend
                reporter.update(len(chunk))
    got = partial.stat().st_size
    if expected is not None and got < expected:
        raise _Dropped(f"connection closed at {got:,} of {expected:,} bytes")


def _range_start(response: Any) -> Optional[int]:
    value = response.headers.get("Content-Range", "")
    unit, _, rest = value.partition(" ")
    start = rest.split("-", 1)[0]
    return int(start) if unit == "bytes" and start.isdigit() else None


def _check(link: WheelLink, path: Path) -> None:
    size = path.stat().st_size
    if link.size is not None and size != link.size:
        path.unlink()
        raise FormatError(f"{link.filename}: got {size} bytes, the index says {link.size}")
    if link.sha256 is None:
        return  # the GGUF's own SHA-256 (registry) is checked after joining anyway
    digest = file_sha256(path)
    if digest != link.sha256:
        path.unlink()
        raise FormatError(
            f"{link.filename}: SHA-256 {digest} does not match the index's {link.sha256}"
        )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fatal(e: BaseException) -> bool:
    """Errors a retry does not mend: TLS certificates, unknown hosts, bad URLs."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, ssl.SSLCertVerificationError):
        return True
    if isinstance(reason, OSError) and getattr(reason, "errno", None) is not None:
        import socket

        return isinstance(reason, socket.gaierror) and reason.errno != socket.EAI_AGAIN
    return isinstance(reason, (ValueError, http.client.InvalidURL))


def _reason(e: BaseException) -> str:
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    text = str(reason).strip() or type(reason).__name__
    return " ".join(text.split())
