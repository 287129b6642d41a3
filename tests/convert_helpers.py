"""Shared helpers of the HF -> .cellm converter tests (test_convert*.py, test_writer.py) and of
test_mla_reference.py: ground truth that does not come from the converter (a minimal safetensors
reader/writer, raw byte reads of the .cellm file per docs/format.md, a float64 bf16 rounding),
fixture copies and edits, and the `python -m cellm.convert` CLI run as a subprocess.

Not a test module: imported as `from convert_helpers import ...` (tests/ is on sys.path, as for
conftest).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from conftest import FIXTURES, ROOT

MODELS = ["llama", "qwen2", "qwen3", "granite", "smollm3"]
DTYPES = ["f32", "f16", "bf16"]
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def load_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, array); BF16 arrays are returned as their raw uint16 bits."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    np_dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        raw = data[8 + n + a : 8 + n + b]
        arr = np.frombuffer(raw, dtype=np_dtype[entry["dtype"]]).reshape(entry["shape"])
        out[name] = (entry["dtype"], arr)
    return out


def save_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, pos = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [pos, pos + len(raw)],
        }
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def as_f32(dtype: str, arr: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def cellm_layout(path: Path) -> tuple[bytes, int, int]:
    """(file bytes, header_len, data_offset), computed from raw bytes per docs/format.md."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[8:16])
    return data, header_len, (16 + header_len + 63) // 64 * 64


def cellm_tensor(path: Path, header: dict[str, Any], name: str) -> tuple[str, np.ndarray]:
    data, _, offset = cellm_layout(path)
    (row,) = [t for t in header["tensors"] if t["name"] == name]
    raw = data[offset + row["offset"] : offset + row["offset"] + row["nbytes"]]
    np_dtype = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}[row["format"]]
    return row["format"], np.frombuffer(raw, dtype=np_dtype).reshape(row["shape"])


def copy_fixture(model: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"hf-{model}"
    shutil.copytree(FIXTURES / model, dst)
    return dst


def edit_json(path: Path, **changes: Any) -> None:
    doc = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            doc.pop(key, None)
        else:
            doc[key] = value
    path.write_text(json.dumps(doc, indent=2))


DELETE = object()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run(
        [sys.executable, "-m", "cellm.convert", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def assert_cli_error(*args: str) -> str:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    assert "Traceback" not in proc.stderr
    return lines[0]


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16, choosing between the two neighbours in float64."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    lo_bits = bits >> 16
    lo = (lo_bits << 16).view(np.float32).astype(np.float64)
    # bf16 spacing at x's exponent; past the largest finite bf16 the next value is 2**128.
    exponent = np.maximum((bits >> 23) & 0xFF, 1).astype(np.float64)
    hi = lo + np.copysign(2.0 ** (exponent - 127 - 7), x.astype(np.float64))
    exact = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = np.abs(exact - lo), np.abs(hi - exact)
    pick_hi = np.isfinite(x) & ((d_hi < d_lo) | ((d_hi == d_lo) & ((lo_bits & 1) == 1)))
    return np.where(pick_hi, lo_bits + 1, lo_bits).astype(np.uint16)
