"""Files a user names: paths inside a user's files (a topology's profile and data files), and
reading a user's text file (a topology, a churn trace) with a limit.

Such a name may be anything: ``~someone`` with no such user, a name longer than the file system
allows, a NUL byte. Each of those names no file, and must come back as one more problem in the
file's list, not as a traceback (``pathlib`` raises RuntimeError, OSError and ValueError there).
"""

from __future__ import annotations

import errno
import os
import stat
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


def read_user_text(path: Path, max_bytes: int, errors: str = "strict") -> str:
    """A user's text file, whole (UTF-8, ``errors`` as for bytes.decode). Raises OSError, its
    ``strerror`` saying why, when the file cannot be read, is not a regular file (a FIFO or a
    device such as /dev/zero would block or never end) or holds more than ``max_bytes``;
    UnicodeDecodeError when it is not text."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file" + (
            " (a directory)" if stat.S_ISDIR(mode) else ""), str(path))
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than the {max_bytes:,} bytes such a file may have",
                      str(path))
    return data.decode("utf-8", errors)
