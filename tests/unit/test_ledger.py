"""The ledger: records survive a kill, a torn tail is cut, tiles are reused only on a match."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from testbed.ps_backend.ledger import (
    Ledger,
    encode_record,
    gemm_digest,
    read_records,
    step_file_name,
)


def tile(seed: int, shape: tuple[int, int] = (4, 3)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def test_round_trip_and_reuse(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.append(2, "s2/l/forward#0", "d0", (0, 4, 0, 3), tile(1), task=7, device="p-0")
    ledger.append(2, "s2/l/forward#0", "d0", (4, 8, 0, 3), tile(2), task=8, device="p-1")
    ledger.append(3, "s3/l/forward#0", "d1", (0, 4, 0, 3), tile(3))
    ledger.close()
    records = read_records(tmp_path / step_file_name(2)).records
    assert [(r.task, r.device, r.box) for r in records] == [(7, "p-0", (0, 4, 0, 3)),
                                                            (8, "p-1", (4, 8, 0, 3))]
    np.testing.assert_array_equal(records[1].c, tile(2))
    again = Ledger(tmp_path)
    assert again.load(from_step=3) == 1  # only steps >= the checkpoint's next step
    assert again.take("s2/l/forward#0", "d0") == {}
    tiles = again.take("s3/l/forward#0", "d1")
    np.testing.assert_array_equal(tiles[(0, 4, 0, 3)], tile(3))
    assert again.take("s3/l/forward#0", "d1") == {}  # served once


def test_a_digest_mismatch_reuses_nothing(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.append(0, "g", "aaaa", (0, 4, 0, 3), tile(1))
    ledger.close()
    again = Ledger(tmp_path)
    again.load(0)
    assert again.take("g", "bbbb") == {} and again.mismatches == 1


def test_digest_depends_on_operands() -> None:
    a, b = tile(1, (4, 5)), tile(2, (5, 3))
    assert gemm_digest(a, b) == gemm_digest(a.copy(), b.copy())
    b2 = b.copy()
    b2[0, 0] += 1e-12
    assert gemm_digest(a, b) != gemm_digest(a, b2)
    assert gemm_digest(a, b) != gemm_digest(a.astype(np.float32), b.astype(np.float32))


def test_digest_of_a_transposed_view_reads_the_stored_tensor() -> None:
    a, w = tile(1, (4, 5)), tile(2, (3, 5))  # Y = A·Wᵀ: B is a transposed view of W
    assert not w.T.flags.c_contiguous
    assert gemm_digest(a, w.T) == gemm_digest(a, w.copy().T)  # the same, whatever its storage
    w2 = w.copy()
    w2[2, 4] -= 1e-12
    assert gemm_digest(a, w.T) != gemm_digest(a, w2.T)
    assert gemm_digest(a, w.T) != gemm_digest(a, np.ascontiguousarray(w.T))  # as stored


def test_torn_and_corrupt_tails_are_cut(tmp_path: Path) -> None:
    path = tmp_path / step_file_name(0)
    good = encode_record(0, "g", "d", (0, 4, 0, 3), tile(1))
    second = encode_record(0, "g", "d", (4, 8, 0, 3), tile(2))
    path.write_bytes(good + second[:-7])  # killed in the middle of a write
    read = read_records(path)
    assert len(read.records) == 1 and read.torn_bytes == len(second) - 7
    flipped = bytearray(good + second)
    flipped[len(good) + 40] ^= 0xFF  # a corrupt byte in the second record
    path.write_bytes(bytes(flipped))
    assert len(read_records(path).records) == 1
    ledger = Ledger(tmp_path)  # appending after a crash first cuts the bad tail
    ledger.append(0, "g", "d", (8, 12, 0, 3), tile(3))
    ledger.close()
    assert [r.box for r in read_records(path).records] == [(0, 4, 0, 3), (8, 12, 0, 3)]


def test_records_of_the_earlier_format_are_still_read(tmp_path: Path) -> None:
    """A run journaled by an earlier version (b"TBL1": a CRC-32 where TBL2 has XXH3-64) resumes
    with its tiles; a corrupt one is cut like any other."""
    def tbl1(box: tuple[int, int, int, int], c: np.ndarray) -> bytes:
        header = json.dumps({"step": 0, "gemm": "g", "digest": "d", "r0": box[0], "r1": box[1],
                             "c0": box[2], "c1": box[3], "dtype": c.dtype.str}).encode()
        payload = c.tobytes()
        return b"".join((b"TBL1", struct.pack("<I", len(header)), header,
                         struct.pack("<Q", len(payload)), payload,
                         struct.pack("<I", zlib.crc32(payload, zlib.crc32(header)))))
    path = tmp_path / step_file_name(0)
    old = tbl1((0, 4, 0, 3), tile(1))
    path.write_bytes(old + encode_record(0, "g", "d", (4, 8, 0, 3), tile(2)))
    records = read_records(path).records
    assert [r.box for r in records] == [(0, 4, 0, 3), (4, 8, 0, 3)]
    assert np.array_equal(records[0].c, tile(1)) and np.array_equal(records[1].c, tile(2))
    flipped = bytearray(old)
    flipped[-10] ^= 0x01
    path.write_bytes(bytes(flipped))
    assert read_records(path).records == [] and read_records(path).torn_bytes == len(old)


def test_a_short_write_is_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``writev`` may write less than the record (a full disk, a signal): the rest follows."""
    real = os.writev

    def short(fd: int, buffers: list) -> int:
        return real(fd, [bytes(buffers[0])[:10]])  # the first 10 bytes only
    monkeypatch.setattr(os, "writev", short)
    ledger = Ledger(tmp_path)
    ledger.append(0, "g", "d", (0, 4, 0, 3), tile(1))
    ledger.append(0, "g", "d", (4, 8, 0, 3), tile(2))
    ledger.close()
    records = read_records(tmp_path / step_file_name(0)).records
    assert [r.box for r in records] == [(0, 4, 0, 3), (4, 8, 0, 3)]
    assert np.array_equal(records[1].c, tile(2))


def test_records_survive_sigkill_without_fsync(tmp_path: Path) -> None:
    code = ("import os, signal, numpy as np\n"
            "from testbed.ps_backend.ledger import Ledger\n"
            f"l = Ledger({str(tmp_path)!r}, fsync_interval_s=1e9)\n"
            "for i in range(50):\n"
            "    l.append(1, 'g', 'd', (i, i + 1, 0, 2), np.full((1, 2), float(i)))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == -9
    records = read_records(tmp_path / step_file_name(1)).records
    assert len(records) == 50 and records[-1].c[0, 0] == 49.0


def test_compaction_keeps_the_last_finished_step(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    for step in range(5):
        ledger.append(step, f"s{step}", "d", (0, 1, 0, 1), np.zeros((1, 1)))
    ledger.compact(next_step=4)  # checkpoint after step 3
    assert [s for s, _ in ledger.files()] == [3, 4]
    ledger.close()
