"""The .cellm writer and reader (cellm.convert.writer) on hand-made tensors, f32 -> bf16
rounding edge cases against a float64 reference, and the converter's progress bar.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from cellm.convert import dtypes, read_header
from cellm.convert.progress import ProgressBar
from cellm.convert.writer import read_tensor, write_cellm
from cellm.errors import FormatError, InvalidArgument
from convert_helpers import as_f32, bf16_reference, cellm_tensor


def test_writer_round_trip_and_reader_checks(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    path = write_cellm(
        tmp_path / "w.cellm",
        {"model": {"x": 1}, "tensors": "ignored"},
        [("a", a, "bf16"), ("b", b, "f32"), ("c", a.astype(np.float16), "f16")],
        [("blob", b"hello")],
    )
    header = read_header(path)
    assert [t["offset"] for t in header["tensors"]] == [0, 64, 128]
    assert header["blobs"] == [{"name": "blob", "offset": 192, "nbytes": 5}]
    assert header["data_size"] == 197
    assert header["model"] == {"x": 1}
    np.testing.assert_array_equal(read_tensor(path, "b"), b)
    np.testing.assert_array_equal(read_tensor(path, "c"), a.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(cellm_tensor(path, header, "a")[1], bf16_reference(a))

    data = path.read_bytes()
    (tmp_path / "short.cellm").write_bytes(data[:-1])
    with pytest.raises(FormatError, match="truncated or padded"):
        read_header(tmp_path / "short.cellm")
    (tmp_path / "v1.cellm").write_bytes(data[:5] + b"\x01" + data[6:])
    with pytest.raises(FormatError, match="version 1"):
        read_header(tmp_path / "v1.cellm")
    with pytest.raises(InvalidArgument, match="duplicate"):
        write_cellm(tmp_path / "d.cellm", {}, [("a", b, "f32"), ("a", b, "f32")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.cellm", "v1.cellm", "w.cellm"]


def test_bf16_rounding_edge_cases() -> None:
    values = np.array(
        [
            1.0,
            -2.5,
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.float32(1.0) + np.float32(2.0**-8),  # exactly half-way, even below: down
            np.float32(1.0) + np.float32(3 * 2.0**-8),  # half-way, odd below: up
            np.float32(1.0) + np.float32(2.0**-8) + np.float32(2.0**-20),  # above half: up
            3.4028235e38,  # rounds past the largest bf16: inf
            1e-45,  # subnormal
        ],
        dtype=np.float32,
    )
    got = dtypes.f32_to_bf16(values)
    np.testing.assert_array_equal(got, bf16_reference(values))
    assert got[6] == 0x3F80 and got[7] == 0x3F82 and got[8] == 0x3F81
    assert got[9] == 0x7F80
    nan = dtypes.f32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.all(np.isnan(as_f32("BF16", nan)))


def test_progress_bar_only_when_forced_or_tty() -> None:
    quiet = io.StringIO()
    with ProgressBar(100, "x", stream=quiet) as bar:
        bar.update(50)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with ProgressBar(100, "x", stream=loud, force=True) as bar:
        bar.update(100)
    text = loud.getvalue()
    assert text.startswith("\rx [") and "100.0%" in text and text.endswith("\n")
