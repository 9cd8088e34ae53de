"""Checkpoints: model, optimizer, step, weight version and RNG state in one file, atomically.

A checkpoint is one ``torch.save`` file (``step-000012.pt`` names a checkpoint taken after step 11,
when the next step to run is 12). It is written as every file of the project that must survive a
power cut: ``user_paths.written_whole(durable=True)``, a temporary file in the same directory,
fsync'ed, renamed over the target (atomic on POSIX), the directory fsync'ed. A process killed at
any moment leaves either the old file or the new one, never a torn one; a leftover temporary is
ignored by :func:`latest_checkpoint` and removed by the PS's next save
(:func:`remove_stale_temporaries`).

Loading uses ``torch.load(weights_only=True)``: a checkpoint holds only tensors and plain data.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from testbed.ps_backend.engine.trainer import Trainer
from testbed.user_paths import temporary_names, written_whole

log = logging.getLogger(__name__)

FORMAT = "testbed-engine-checkpoint/1"
_NAME_RE = re.compile(r"^step-(\d{6,})\.pt$")
_TEMP_RE = temporary_names(r"step-\d{6,}\.pt")  # save_atomic's temporaries


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit the trainer."""


def checkpoint_name(next_step: int) -> str:
    """File name of the checkpoint whose next step is ``next_step``."""
    return f"step-{next_step:06d}.pt"


def save_atomic(obj: Any, path: str | Path) -> Path:
    """``torch.save`` obj to path so that path is always either the old or the new file."""
    path = Path(path)
    with written_whole(path, binary=True, durable=True) as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            # torch's writer turns a failed write into 'unexpected pos 571264 vs 571152'; the
            # write's own error (a full disk) is its context: say that one
            failed = exc.__context__
            if isinstance(failed, OSError) and failed.errno is not None:
                raise OSError(failed.errno, failed.strerror, str(path)) from None
            raise
    return path


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporaries of checkpoints that :func:`save_atomic` left in ``directory``
    (a save killed before its rename); return them. Only names of its pattern
    (``.step-NNNNNN.pt.PID-XXXXXXXX``) are touched. Called by the one process that writes a
    run's checkpoints, after a save of its own, so no save is under way meanwhile."""
    removed = []
    for entry in Path(directory).iterdir():
        if _TEMP_RE.fullmatch(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def save_checkpoint(trainer: Trainer, path: str | Path) -> Path:
    """Write the trainer's full state to ``path`` atomically; return the path."""
    state = {"format": FORMAT, **trainer.state_dict()}
    out = save_atomic(state, path)
    log.info("checkpoint at step %d written to %s", trainer.next_step, out)
    return out


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint file's state (format checked, not yet applied to a trainer)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: no such checkpoint") from exc
    except Exception as exc:  # torch raises several types for a torn or foreign file
        raise CheckpointError(f"{path}: not a readable checkpoint ({exc})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: expected format {FORMAT!r}, found {found!r}")
    return state


def apply_checkpoint(trainer: Trainer, state: dict[str, Any], path: str | Path) -> int:
    """Restore the trainer from a state read from ``path``; return the next step to run."""
    try:
        trainer.load_state_dict(state)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return trainer.next_step


def load_checkpoint(trainer: Trainer, path: str | Path) -> int:
    """Restore the trainer from ``path``; return the next step to run."""
    next_step = apply_checkpoint(trainer, read_checkpoint(path), path)
    log.info("resumed from %s at step %d", path, next_step)
    return next_step


def load_resume_point(trainer: Trainer, directory: str | Path) -> tuple[Path | None, list[float]]:
    """Restore the trainer from the newest checkpoint in ``directory``, as the PS's
    ``--resume`` does; return it (None: there is none, the run starts at step 0) and the losses
    of the steps it covers (the PS's ``{"ps": {"losses": [...]}}``). Writes nothing, so
    ``testbed up --resume`` calls it on a trainer of its own before it starts anything.

    CheckpointError, naming the file, when ``directory`` is no directory, when the checkpoint
    cannot be read or belongs to another job (model shape, dtype, seed), when its file name's
    step is not the step it holds, or when its losses are not numbers.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: expected the checkpoints' directory, found a file")
    path = latest_checkpoint(directory)
    if path is None:
        return None, []
    state = read_checkpoint(path)
    next_step = apply_checkpoint(trainer, state, path)
    m = _NAME_RE.match(path.name)
    assert m is not None  # latest_checkpoint matched it
    if int(m.group(1)) != next_step:
        raise CheckpointError(f"{path}: its name says step {int(m.group(1))}, but it holds the "
                              f"state before step {next_step}")
    extra = state.get("ps") or {}
    losses = extra.get("losses", []) if isinstance(extra, dict) else None
    if not isinstance(losses, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
        raise CheckpointError(f"{path}: ps.losses: expected a list of numbers")
    return path, [float(x) for x in losses][:next_step]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``directory`` (None when there is none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for entry in directory.iterdir():
        m = _NAME_RE.match(entry.name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), entry)
    return None if best is None else best[1]
