"""The ledger: an append-only journal of completed tiles; a killed PS loses no finished work.

Layout: ``<run_dir>/ledger/step-000012.tiles`` holds the tiles accepted during step 12, one
record each, in the order they were accepted. A record is::

    b"TBL2" | u32 header length | header (JSON, UTF-8) | u64 payload length | payload | u64 hash

(little-endian; the hash, XXH3-64, covers header and payload; records of ``b"TBL1"``, which
earlier versions wrote, end in a u32 CRC-32 instead and are still read). The header names the
tile: ``gemm`` (the GEMM's uid, ``s<step>/<layer>/<op>#<seq>``, deterministic across a
restart), ``digest`` (a checksum of the GEMM's A and B), the box ``r0 r1 c0 c1`` (and ``k0 k1``
for a partial of a K-split GEMM), ``dtype``, and for the record ``task``, ``attempt``,
``device``. The payload is the tile's C, row-major.

**Durability (the fsync policy).** Each record goes to the file with one ``write`` on an
``O_APPEND`` descriptor as soon as the tile is accepted, so a PS killed with SIGKILL keeps every
tile it accepted (the kernel holds the page). ``fsync`` runs at most every
``FSYNC_INTERVAL_S`` (0.2 s) from the PS's periodic tick and at every step end before the
checkpoint, so a host crash loses at most the last 0.2 s of tiles. Losing them costs only their
recomputation: a torn or corrupt tail is detected by length and hash, cut off, and reading
stops there. A record goes out with one ``writev`` of its header, the tile's own memory and the
hash, so the PS's loop thread never copies a tile to journal it: 8.7 GB of results a hotcarbon
step went through two copies and a CRC-32 each, on the loop's own time while results stream in
(``bench/operand_digest.py`` prints the hashes' rates).

**Reuse.** After a restart the PS restores the last checkpoint (next step ``s``) and loads every
record of steps ``>= s``. When the trainer submits a GEMM whose uid *and* digest match, the
recorded tiles are placed straight into C and only the rest goes to devices. A digest mismatch
(the operands differ: not the same computation) ignores those records. A record whose hash is
intact but whose header is not as :func:`record_parts` writes it is no torn write (an edit, a
file of another program): :func:`journal_problems` reports it, and ``testbed up --resume``
refuses the run before it starts anything rather than cut it and what follows.

**Compaction.** Once the checkpoint whose next step is ``s`` is durable, files of steps
``< s - 1`` are deleted: the journal of the last finished step stays as its audit record.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import xxhash

from testbed.user_paths import load_user_json

log = logging.getLogger(__name__)

MAGIC = b"TBL2"
MAGIC_CRC32 = b"TBL1"  # earlier versions' records: a u32 CRC-32 where TBL2 has its hash
FSYNC_INTERVAL_S = 0.2
MAX_HEADER_BYTES = 1 << 16
_NAME_RE = re.compile(r"^step-(\d{6,})\.tiles$")
Box = tuple[int, ...]  # r0, r1, c0, c1 (+ k0, k1 for a K-split partial)


def gemm_digest(a: np.ndarray, b: np.ndarray) -> str:
    """A checksum of a GEMM's operands (shape, dtype and bytes of A and of B: XXH3-64 each).

    It tells a journaled tile's computation from another (a restart that restored a different
    checkpoint, a changed job), as the records' own hash tells a torn record; nothing hostile
    chooses the operands, so a fast non-cryptographic hash serves. The trainer computes it
    before each GEMM is submitted, on the step's critical path, over every operand byte (5.2 GB
    a step of OPT-125m on hotcarbon; ``bench/operand_digest.py``: BLAKE2b at ~0.8 GB/s would
    cost 6-7 s of it, CRC-32 at 3.3-4.2 GB/s 1.2-1.6 s, XXH3 at 23-29 GB/s 0.2 s), each
    operand's once a step although it serves two GEMMs of its linear (``TileExecutor`` keeps
    them by operand key). A transposed view (Wᵀ, dYᵀ) is checksummed as its stored tensor, with
    the orientation after it, rather than copied to C order first.
    """
    return "".join(stored_digest(stored) + flag for stored, flag in map(stored_operand, (a, b)))


def stored_operand(x: np.ndarray) -> tuple[np.ndarray, str]:
    """(the tensor ``x`` is a view of, as stored; ``"T"`` when ``x`` is its transpose)."""
    if not x.flags.c_contiguous and x.T.flags.c_contiguous:
        return x.T, "T"
    return np.ascontiguousarray(x), ""


def stored_digest(stored: np.ndarray) -> str:
    """XXH3-64 of a C-ordered array's shape, dtype and bytes, as 16 hex digits."""
    return _xxh3(f"{stored.shape}{stored.dtype.str}".encode(), stored.data).hexdigest()


def _xxh3(*buffers: bytes | memoryview) -> Any:
    """XXH3-64 over the buffers in order (no copy of them)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h


def step_file_name(step: int) -> str:
    """File name of the journal of one training step."""
    return f"step-{step:06d}.tiles"


@dataclass
class LedgerRecord:
    """One accepted tile as read back from the journal."""

    step: int
    gemm: str
    digest: str
    box: Box
    c: np.ndarray
    task: int = -1
    attempt: int = 0
    device: str = ""


@dataclass
class ReadResult:
    records: list[LedgerRecord]
    good_bytes: int  # length of the readable prefix
    torn_bytes: int  # bytes after it (a torn or corrupt tail)
    # why reading stopped at a record whose hash is intact but whose header is not as
    # record_parts writes it (no torn write makes one: an edit, or another program's file)
    damaged: str | None = None


def record_parts(step: int, gemm: str, digest: str, box: Box, c: np.ndarray,
                 task: int = -1, attempt: int = 0, device: str = "") -> list[bytes | memoryview]:
    """One journal record as buffers to write in order: its head, the tile's C (its own memory
    when C-contiguous) and the hash."""
    header = json.dumps({"step": step, "gemm": gemm, "digest": digest, "r0": box[0],
                         "r1": box[1], "c0": box[2], "c1": box[3], "dtype": c.dtype.str,
                         "task": task, "attempt": attempt, "device": device,
                         **({"k0": box[4], "k1": box[5]} if len(box) == 6 else {})},
                        separators=(",", ":")).encode()
    payload = np.ascontiguousarray(c).data.cast("B")
    return [b"".join((MAGIC, struct.pack("<I", len(header)), header,
                      struct.pack("<Q", payload.nbytes))),
            payload, struct.pack("<Q", _xxh3(header, payload).intdigest())]


def encode_record(step: int, gemm: str, digest: str, box: Box, c: np.ndarray,
                  task: int = -1, attempt: int = 0, device: str = "") -> bytes:
    """The bytes of one journal record."""
    return b"".join(record_parts(step, gemm, digest, box, c, task, attempt, device))


def read_records(path: Path) -> ReadResult:
    """Every intact record of one journal file, up to the first torn or corrupt one."""
    data = path.read_bytes()
    records: list[LedgerRecord] = []
    pos = 0
    damaged = None
    while pos < len(data):
        try:
            record, end = _decode_at(data, pos)
        except _DamagedRecord as exc:
            damaged = f"record {len(records) + 1} (byte {pos}): {exc}"
            break
        if record is None:
            break
        records.append(record)
        pos = end
    return ReadResult(records, pos, len(data) - pos, damaged)


class _DamagedRecord(ValueError):
    """A record with an intact hash and a header that is not as record_parts writes it."""


def _header_int(h: dict[str, Any], key: str, default: int | None = None) -> int:
    value = h.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _DamagedRecord(f"header field {key!r}: expected an integer, found {value!r}")
    return value


def _header_str(h: dict[str, Any], key: str, default: str | None = None) -> str:
    value = h.get(key, default)
    if not isinstance(value, str):
        raise _DamagedRecord(f"header field {key!r}: expected a string, found {value!r}")
    return value


def _decode_at(data: bytes, pos: int) -> tuple[LedgerRecord | None, int]:
    magic = data[pos:pos + 4]
    if magic not in (MAGIC, MAGIC_CRC32) or pos + 8 > len(data):
        return None, pos
    (hlen,) = struct.unpack_from("<I", data, pos + 4)
    if hlen > MAX_HEADER_BYTES or pos + 8 + hlen + 8 > len(data):
        return None, pos
    header = data[pos + 8:pos + 8 + hlen]
    (plen,) = struct.unpack_from("<Q", data, pos + 8 + hlen)
    start = pos + 16 + hlen
    end = start + plen + (8 if magic == MAGIC else 4)
    if end > len(data):
        return None, pos
    payload = data[start:start + plen]
    if magic == MAGIC:
        intact = struct.unpack_from("<Q", data, start + plen)[0] == \
            _xxh3(header, payload).intdigest()
    else:
        intact = struct.unpack_from("<I", data, start + plen)[0] == \
            zlib.crc32(payload, zlib.crc32(header))
    if not intact:
        return None, pos
    try:
        h = load_user_json(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _DamagedRecord(f"header is not JSON ({exc})") from None
    if not isinstance(h, dict):
        raise _DamagedRecord(f"header: expected a JSON object, found {type(h).__name__}")
    box: Box = tuple(_header_int(h, k) for k in ("r0", "r1", "c0", "c1"))
    if "k0" in h:
        box = box + (_header_int(h, "k0"), _header_int(h, "k1"))
    try:
        c = np.frombuffer(payload, dtype=np.dtype(_header_str(h, "dtype"))).reshape(
            box[1] - box[0], box[3] - box[2])
    except (ValueError, TypeError) as exc:
        raise _DamagedRecord(f"payload does not fit the header's dtype and box ({exc})") \
            from None
    return LedgerRecord(_header_int(h, "step"), _header_str(h, "gemm"),
                        _header_str(h, "digest"), box, c.copy(), _header_int(h, "task", -1),
                        _header_int(h, "attempt", 0), _header_str(h, "device", "")), end


def journal_problems(directory: Path) -> list[str]:
    """What keeps the journal in ``directory`` from being loaded and appended to, each problem
    naming its file: ``directory`` not a directory, a step's journal not a regular file, a
    record with an intact hash but a header not as written, a record of another step. A torn
    or corrupt tail is no problem (it is cut off, as after any kill). [] when there is none."""
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        return [f"{directory}: expected the ledger's directory, found a file"]
    problems = []
    for entry in sorted(directory.iterdir()):
        m = _NAME_RE.match(entry.name)
        if not m:
            continue
        if not entry.is_file():
            problems.append(f"{entry}: expected a journal file, found "
                            f"{'a directory' if entry.is_dir() else 'no regular file'}")
            continue
        try:
            read = read_records(entry)
        except OSError as exc:
            problems.append(f"{entry}: cannot be read ({exc.strerror})")
            continue
        if read.damaged is not None:
            problems.append(f"{entry}: {read.damaged}")
        other = sorted({r.step for r in read.records} - {int(m.group(1))})
        if other:
            problems.append(f"{entry}: holds records of step(s) {other[:5]}, not only of step "
                            f"{int(m.group(1))}")
    return problems


@dataclass
class _GemmTiles:
    digest: str
    tiles: dict[Box, np.ndarray] = field(default_factory=dict)


class Ledger:
    """The journal of one run: append accepted tiles, fsync in batches, serve them after a crash."""

    def __init__(self, directory: Path, fsync_interval_s: float = FSYNC_INTERVAL_S):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync_interval_s = fsync_interval_s
        self._fd: int | None = None
        self._step: int | None = None
        self._dirty = False
        self._last_sync_s = time.monotonic()
        self._index: dict[str, _GemmTiles] = {}  # records loaded for reuse, by GEMM uid
        self.appended = 0
        self.syncs = 0
        self.served = 0
        self.mismatches = 0

    # -- writing -------------------------------------------------------------------------------
    def append(self, step: int, gemm: str, digest: str, box: Box, c: np.ndarray, task: int = -1,
               attempt: int = 0, device: str = "") -> None:
        """Journal one accepted tile (one write; durable against a process kill at once)."""
        if self._step != step:
            self._open(step)
        assert self._fd is not None
        parts = record_parts(step, gemm, digest, box, c, task, attempt, device)
        left = sum(len(p) for p in parts) - os.writev(self._fd, parts)
        if left:  # short (a full disk, a signal): the rest, or a torn tail the reader cuts
            os.write(self._fd, b"".join(bytes(p) for p in parts)[-left:])
        self._dirty = True
        self.appended += 1

    def _open(self, step: int) -> None:
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
        path = self.directory / step_file_name(step)
        if path.exists():  # a file from before a crash: cut a torn tail before appending
            read = read_records(path)
            if read.torn_bytes:
                log.warning("%s: cutting a torn tail of %d byte(s)", path, read.torn_bytes)
                os.truncate(path, read.good_bytes)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._step = step
        _fsync_dir(self.directory)

    def sync(self) -> None:
        """fsync the open journal file if anything was written since the last sync."""
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self.syncs += 1
        self._dirty = False
        self._last_sync_s = time.monotonic()

    def maybe_sync(self) -> None:
        """fsync when the last sync is older than the interval (called from a periodic tick)."""
        if self._dirty and time.monotonic() - self._last_sync_s >= self.fsync_interval_s:
            self.sync()

    def compact(self, next_step: int) -> list[Path]:
        """A checkpoint with this next step is durable: delete journals of steps < next - 1."""
        removed = []
        for step, path in self.files():
            if step < next_step - 1 and step != self._step:
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def close(self) -> None:
        """Sync and close the open journal file."""
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._step = None, None

    # -- reading -------------------------------------------------------------------------------
    def files(self) -> list[tuple[int, Path]]:
        """(step, path) of every journal file, by step."""
        out = []
        for entry in self.directory.iterdir():
            m = _NAME_RE.match(entry.name)
            if m:
                out.append((int(m.group(1)), entry))
        return sorted(out)

    def load(self, from_step: int) -> int:
        """Index every record of steps >= from_step for reuse; return how many."""
        count = 0
        for step, path in self.files():
            if step < from_step:
                continue
            read = read_records(path)
            if read.damaged is not None:
                log.warning("%s: %s; it and what follows are ignored", path, read.damaged)
            elif read.torn_bytes:
                log.warning("%s: %d byte(s) after the last intact record are ignored", path,
                            read.torn_bytes)
            for r in read.records:
                entry = self._index.get(r.gemm)
                if entry is None or entry.digest != r.digest:
                    entry = self._index[r.gemm] = _GemmTiles(r.digest)
                if r.box not in entry.tiles:
                    entry.tiles[r.box] = r.c
                    count += 1
        return count

    @property
    def indexed(self) -> int:
        """Tiles loaded for reuse and not served yet."""
        return sum(len(e.tiles) for e in self._index.values())

    def take(self, gemm: str, digest: str) -> dict[Box, np.ndarray]:
        """The recorded tiles of a GEMM, if its digest matches (each served once)."""
        entry = self._index.pop(gemm, None)
        if entry is None:
            return {}
        if entry.digest != digest:
            self.mismatches += 1
            log.warning("ledger: %s has other operands than before the restart; its %d "
                        "recorded tile(s) are not reused", gemm, len(entry.tiles))
            return {}
        self.served += len(entry.tiles)
        return entry.tiles


def iter_step_records(directory: Path, step: int) -> Iterator[LedgerRecord]:
    """The intact records of one step's journal (empty if there is none)."""
    path = Path(directory) / step_file_name(step)
    if path.exists():
        yield from read_records(path).records


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(ledger: Ledger) -> dict[str, Any]:
    """Counters for logs and summaries."""
    return {"appended": ledger.appended, "syncs": ledger.syncs, "served": ledger.served,
            "mismatches": ledger.mismatches}
