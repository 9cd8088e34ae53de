"""Training data: byte-level tokens (vocab 256) and a seeded batch sampler.

Corpora:

* ``builtin`` — the Python standard library's own ``.py`` sources, a text every machine with
  Python has. Files are found under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``,
  ``dist-packages`` and ``__pycache__`` are left out, they differ between machines), sorted by
  their path relative to that directory, and read in that order until ``cap_bytes`` (4 MiB by
  default) are collected; the last file is cut at the cap. Two machines with the same Python
  version get the same bytes; :attr:`Corpus.sha256` tells.
* ``files`` — the files the user named (``job.data.files``), read as bytes in the order given.

A token is one byte (0..255). ``BatchSampler.batch(step)`` draws ``batch_size`` windows of
``seq_len + 1`` bytes at offsets chosen by a generator seeded with ``(seed, step)`` only, so a run
resumed at step ``s`` gets the same batch for ``s`` as the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from testbed.topology import DataSpec

log = logging.getLogger(__name__)

BUILTIN_CAP_BYTES = 4 * 2**20
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The corpus cannot be read or is too small for the job."""


@dataclass(frozen=True)
class Corpus:
    """A byte corpus: ``tokens`` is a 1-D uint8 tensor, ``name`` says where it came from."""

    name: str
    tokens: torch.Tensor
    files: int  # how many files contributed

    @property
    def sha256(self) -> str:
        """Digest of the corpus bytes (to compare runs across machines)."""
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()

    def __len__(self) -> int:
        return int(self.tokens.numel())


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The ``.py`` files of the standard library, sorted by relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


@lru_cache(maxsize=4)
def builtin_corpus(cap_bytes: int = BUILTIN_CAP_BYTES) -> Corpus:
    """The standard-library corpus, capped to ``cap_bytes`` bytes (cached per process)."""
    base = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_sources(base):
        if total >= cap_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError as exc:  # an unreadable file would make the corpus machine-dependent
            raise DataError(f"builtin corpus: cannot read {path}: {exc.strerror}") from exc
        data = data[: cap_bytes - total]
        chunks.append(data)
        total += len(data)
    if not chunks:
        raise DataError(f"builtin corpus: no .py files under {base}")
    tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    corpus = Corpus(f"stdlib:{base}", tokens, len(chunks))
    log.info("builtin corpus: %d bytes from %d files under %s", len(corpus), len(chunks), base)
    return corpus


def files_corpus(files: tuple[Path, ...] | list[Path]) -> Corpus:
    """The named files' bytes, concatenated in the order given."""
    if not files:
        raise DataError("job.data.files: expected at least one file")
    chunks: list[bytes] = []
    for i, path in enumerate(files):
        try:
            chunks.append(Path(path).read_bytes())
        except OSError as exc:
            raise DataError(f"job.data.files[{i}]: cannot read {path}: {exc.strerror}") from exc
    tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8) \
        if sum(map(len, chunks)) else torch.zeros(0, dtype=torch.uint8)
    return Corpus("files:" + ",".join(str(f) for f in files), tokens, len(chunks))


def load_corpus(spec: DataSpec) -> Corpus:
    """The corpus a job's data spec names."""
    if spec.kind == "builtin":
        return builtin_corpus()
    if spec.kind == "files":
        return files_corpus(spec.files)
    raise DataError(f"job.data: unknown kind {spec.kind!r} (expected 'builtin' or 'files')")


class BatchSampler:
    """Seeded random windows of a corpus: ``batch(step) -> (inputs, targets)``, [B, T] int64."""

    def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise DataError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be positive")
        need = seq_len + 1
        if len(corpus) < need:
            raise DataError(f"corpus {corpus.name} has {len(corpus)} bytes; a window of "
                            f"seq_len + 1 = {need} bytes is needed (use longer files or a "
                            f"shorter job.model.seq_len)")
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._offsets = torch.arange(need)

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the batch's windows for ``step`` (depends on seed and step only)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.corpus) - self.seq_len, size=self.batch_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for ``step``, both [batch_size, seq_len] int64."""
        starts = torch.from_numpy(self.offsets(step)).to(torch.int64)
        windows = self.corpus.tokens[starts[:, None] + self._offsets[None, :]].to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
