"""Downloading wheels without pip (cellm.index, cellm.download), offline: the index read from
the user's configuration in pip's precedence, a fake simple index (JSON and HTML) served on
127.0.0.1, exact-version wheel selection, the index's SHA-256, resuming `.partial` files
(with and without Range support), retries after a dropped connection, plain progress lines."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from cellm import download, index
from cellm.errors import FormatError
from index_helpers import FakeIndex, IndexServer, isolate_pip_config, make_wheel, sha256

PAYLOAD = bytes(range(256)) * 2048  # 512 KiB, not compressible to nothing
MEMBER = "fake_pkg/data/blob.bin"


@pytest.fixture
def site(tmp_path) -> FakeIndex:
    site = FakeIndex()
    wheels = tmp_path / "built"
    for version in ("0.9.0", "1.0.0", "1.0.10"):
        site.add("fake-pkg", make_wheel(wheels, "fake-pkg", version, MEMBER, PAYLOAD + b"v" * 7))
    site.projects["fake-pkg"]["fake_pkg-1.0.0.tar.gz"] = b"an sdist"
    return site


@pytest.fixture
def server(site, monkeypatch):
    srv = IndexServer(site)
    isolate_pip_config(monkeypatch, srv.index_url)
    yield srv
    srv.stop()


def wheel_bytes(site: FakeIndex, name: str = "fake_pkg-1.0.0-py3-none-any.whl") -> bytes:
    return site.projects["fake-pkg"][name]


# --- where the index comes from ---------------------------------------------------------------


def write_conf(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_index_precedence_env_over_config_over_pip_default(tmp_path, monkeypatch):
    isolate_pip_config(monkeypatch)
    early = write_conf(
        tmp_path / "site-wide.conf", "[global]\nindex-url = http://early.test/simple\n"
    )
    late = write_conf(tmp_path / "user.conf", "[global]\nindex-url = http://late.test/simple/\n")
    monkeypatch.setattr(index, "config_files", lambda: [early, late])
    monkeypatch.setattr(index, "pip_default_index", lambda: "http://default.test/simple")
    # The later file in pip's load order wins; the trailing slash goes.
    assert index.index_url() == index.Index("http://late.test/simple", str(late))
    # [download] (or [install]) in any file beats [global] in any file, as in pip.
    write_conf(early, "[install]\nindex-url = http://install.test/s\n")
    assert index.index_url().url == "http://install.test/s"
    write_conf(late, "[download]\nindex-url = http://download.test/s\n[global]\nindex-url = x\n")
    assert index.index_url().url == "http://download.test/s"
    # uv's variables over config files, pip's over uv's.
    monkeypatch.setenv("UV_INDEX_URL", "http://uv-old.test/simple")
    assert index.index_url() == index.Index("http://uv-old.test/simple", "UV_INDEX_URL")
    monkeypatch.setenv("UV_DEFAULT_INDEX", "http://uv.test/simple")
    assert index.index_url().source == "UV_DEFAULT_INDEX"
    monkeypatch.setenv("PIP_INDEX_URL", "http://pip.test/simple")
    assert index.index_url() == index.Index("http://pip.test/simple", "PIP_INDEX_URL")
    # Nothing configured: pip's default; nor that: one line asking for PIP_INDEX_URL.
    for var in ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL"):
        monkeypatch.delenv(var)
    monkeypatch.setattr(index, "config_files", lambda: [])
    assert index.index_url() == index.Index("http://default.test/simple", "pip's default")
    monkeypatch.setattr(index, "pip_default_index", lambda: None)
    with pytest.raises(index.IndexNotConfigured, match="set PIP_INDEX_URL") as err:
        index.index_url()
    assert isinstance(err.value, OSError) and "\n" not in str(err.value)


@pytest.mark.skipif(sys.platform != "linux", reason="the Linux file locations")
def test_config_files_in_pips_load_order(tmp_path, monkeypatch):
    home, xdg, venv = tmp_path / "home", tmp_path / "xdg", tmp_path / "venv"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "etc-xdg"))
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    env_file = tmp_path / "custom.conf"
    monkeypatch.setenv("PIP_CONFIG_FILE", str(env_file))
    expected = [
        tmp_path / "etc-xdg" / "pip" / "pip.conf",
        Path("/etc/pip.conf"),
        home / ".pip" / "pip.conf",
        xdg / "pip" / "pip.conf",
        venv / "pip.conf",
        env_file,
    ]
    assert index.config_files() == expected
    # An existing PIP_CONFIG_FILE stands in for the user's files; os.devnull turns all off.
    env_file.write_text("[global]\n")
    assert index.config_files() == expected[:2] + expected[4:]
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    assert index.config_files() == []


def test_config_file_values_and_find_links(tmp_path, monkeypatch):
    isolate_pip_config(monkeypatch)
    wheels = tmp_path / "wheels"
    wheel = make_wheel(wheels, "fake-pkg", "1.0.0", MEMBER, b"x")
    conf = write_conf(
        tmp_path / "pip.conf",
        f"[global]\ntimeout = 7\ncert = {tmp_path / 'ca.pem'}\n"
        f"find-links =\n    {wheels}\n    http://links.test/wheels/\n",
    )
    monkeypatch.setattr(index, "config_files", lambda: [conf])
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.delenv("PIP_DEFAULT_TIMEOUT")
    monkeypatch.delenv("PIP_CERT", raising=False)
    assert index.find_links() == [wheels]  # URLs are not local directories: skipped
    assert index.timeout() == 7.0
    assert index.ca_bundle() == str(tmp_path / "ca.pem")
    assert index.local_wheel("Fake_Pkg", "1.0.0") == wheel  # PEP 503 names
    assert index.local_wheel("fake-pkg", "1.0") is None  # exact versions only
    # The environment over the files, as in pip.
    monkeypatch.setenv("PIP_FIND_LINKS", f"file://{tmp_path / 'nothing'} {tmp_path}")
    assert index.find_links() == [tmp_path]
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2.5")
    assert index.timeout() == 2.5
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "soon")
    assert index.timeout() == index.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("PIP_CERT", "/the/ca.pem")
    assert index.ca_bundle() == "/the/ca.pem"


def test_pip_default_read_without_importing_pip(monkeypatch):
    source = 'x = 1\nPyPI = PackageIndex("https://index.example/", file_storage_domain="f")\n'
    assert index.simple_url_from_source(source) == "https://index.example/simple"
    assert index.simple_url_from_source("PyPI = None\n") is None
    if index._ensurepip_wheel() is None:
        pytest.skip("this Python has no ensurepip wheel of pip")
    with_pip = index.pip_default_index()
    monkeypatch.setitem(sys.modules, "pip", None)  # `import pip` now fails
    from_wheel = index.pip_default_index()
    assert from_wheel and from_wheel.endswith("/simple")
    if with_pip is not None:
        assert from_wheel == with_pip


def test_redact_hides_passwords():
    assert index.redact("https://me:secret@host.test/simple") == "https://me:****@host.test/simple"
    assert index.redact("https://token@host.test/simple") == "https://****@host.test/simple"
    assert index.redact("https://host.test/simple") == "https://host.test/simple"


# --- the simple API ---------------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "html"])
def test_find_wheel_picks_the_exact_version(site, server, as_json):
    site.json = as_json
    session = download.Session()
    link = download.find_wheel(session, server.index_url, "Fake.Pkg", "1.0.0")
    assert link.filename == "fake_pkg-1.0.0-py3-none-any.whl"
    assert link.url == f"{server.url}/files/fake-pkg/{link.filename}"
    assert link.sha256 == sha256(wheel_bytes(site))
    assert link.size == (len(wheel_bytes(site)) if as_json else None)
    path, headers, status = site.log[-1]
    assert path == "/simple/fake-pkg/" and status == 200
    assert headers["accept"].startswith(index_json_type())
    assert headers["user-agent"].startswith("cellm/")


def index_json_type() -> str:
    return "application/vnd.pypi.simple.v1+json"


def test_missing_package_and_version_are_one_line_errors(server):
    session = download.Session()
    with pytest.raises(download.DownloadError, match="not on the package index") as err:
        download.find_wheel(session, server.index_url, "no-such-pkg", "1.0")
    assert isinstance(err.value, OSError) and "\n" not in str(err.value)
    with pytest.raises(download.DownloadError, match=r"1\.0\.0, 1\.0\.10"):
        download.find_wheel(session, server.index_url, "fake-pkg", "2.0")


def test_unreachable_index_is_one_line_error(monkeypatch):
    isolate_pip_config(monkeypatch)
    srv = IndexServer(FakeIndex())
    url = srv.index_url
    srv.stop()  # nothing listens there any more
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    with pytest.raises(download.DownloadError, match="cannot reach the package index"):
        download.find_wheel(download.Session(timeout=5), url, "fake-pkg", "1.0.0")


# --- downloads --------------------------------------------------------------------------------


def get(server, tmp_path, reporter=None, **kw) -> Path:
    session = download.Session()
    link = download.find_wheel(session, server.index_url, "fake-pkg", "1.0.0")
    folder = tmp_path / "dl"
    folder.mkdir(exist_ok=True)
    return download.download(session, link, folder, reporter, **kw)


def test_download_checks_the_index_sha256(site, server, tmp_path):
    path = get(server, tmp_path)
    assert path.read_bytes() == wheel_bytes(site)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    path.unlink()
    site.wrong_sha = True
    with pytest.raises(FormatError, match="does not match the index's"):
        get(server, tmp_path)
    assert list((tmp_path / "dl").iterdir()) == []  # neither the file nor a .partial


def test_resume_with_range(site, server, tmp_path):
    data = wheel_bytes(site)
    folder = tmp_path / "dl"
    folder.mkdir()
    half = len(data) // 2
    (folder / "fake_pkg-1.0.0-py3-none-any.whl.partial").write_bytes(data[:half])
    stream = io.StringIO()
    path = get(server, tmp_path, download.Reporter("fake-pkg==1.0.0 (1/1)", stream=stream))
    assert path.read_bytes() == data
    ((_, headers, status),) = site.requests_for(".whl")
    assert headers["range"] == f"bytes={half}-" and status == 206
    assert f"resuming at {half / 2**20:,.1f} MiB" in stream.getvalue()


def test_server_ignoring_range_gets_a_clean_redo(site, server, tmp_path):
    site.ranges = False
    data = wheel_bytes(site)
    folder = tmp_path / "dl"
    folder.mkdir()
    (folder / "fake_pkg-1.0.0-py3-none-any.whl.partial").write_bytes(b"stale bytes" * 100)
    path = get(server, tmp_path)
    assert path.read_bytes() == data
    ((_, headers, status),) = site.requests_for(".whl")
    assert "range" in headers and status == 200


def test_dropped_connection_is_retried_and_resumed(site, server, tmp_path, monkeypatch):
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    site.drop_after, site.drops = 100_000, 2
    stream = io.StringIO()
    path = get(server, tmp_path, download.Reporter("fake-pkg==1.0.0 (1/1)", stream=stream))
    assert path.read_bytes() == wheel_bytes(site)
    ranges = [h.get("range") for _, h, _ in site.requests_for(".whl")]
    assert ranges == [None, "bytes=100000-", "bytes=200000-"]
    assert stream.getvalue().count("retrying") == 2


def test_dropping_server_gives_up_and_keeps_the_partial_file(site, server, tmp_path, monkeypatch):
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    site.drop_after, site.drops = 50_000, 10
    with pytest.raises(download.DownloadError, match="gave up after 3 tries") as err:
        get(server, tmp_path)
    assert "\n" not in str(err.value)
    partial = tmp_path / "dl" / "fake_pkg-1.0.0-py3-none-any.whl.partial"
    assert partial.stat().st_size == 150_000
    site.drops = 0  # the network is back: the next run continues from 150000
    assert get(server, tmp_path).read_bytes() == wheel_bytes(site)
    assert site.requests_for(".whl")[-1][1]["range"] == "bytes=150000-"


def test_plain_progress_line_when_not_a_terminal(server, tmp_path):
    stream = io.StringIO()
    get(server, tmp_path, download.Reporter("fake-pkg==1.0.0 (1/2)", stream=stream))
    text = stream.getvalue()
    assert "\r" not in text and text.count("\n") == 1, text
    assert text.startswith("cellm: downloading fake-pkg==1.0.0 (1/2) ... 0.5 MiB in "), text
    assert text.endswith(" s\n")


def test_progress_bar_on_a_terminal(server, tmp_path):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    get(server, tmp_path, download.Reporter("fake-pkg==1.0.0 (1/1)", stream=stream))
    assert "fake-pkg==1.0.0 (1/1)" in stream.getvalue() and "100%" in stream.getvalue()
