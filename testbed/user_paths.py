"""Paths named inside a user's files (a topology's profile and data files, a profile by path).

Such a name may be anything: ``~someone`` with no such user, a name longer than the file system
allows, a NUL byte. Each of those names no file, and must come back as one more problem in the
file's list, not as a traceback (``pathlib`` raises RuntimeError, OSError and ValueError there).
"""

from __future__ import annotations

from pathlib import Path


def user_path(name: str, base_dir: Path | None) -> Path:
    """``name`` with ``~`` expanded (left as written when there is no such home), relative to
    ``base_dir`` unless absolute."""
    path = Path(name)
    try:
        path = path.expanduser()
    except RuntimeError:  # ~user with no such user, or no home at all
        pass
    return path if path.is_absolute() or base_dir is None else base_dir / path


def is_file(path: Path) -> bool:
    """Path.is_file, False where the name itself is one no file can have."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False
