"""Files a user names: paths inside a user's files (a topology's profile and data files),
reading a user's text file (a topology, a churn trace) with a limit, and writing the file a
command's ``--out`` or ``-o`` names (a measurement CSV, a trace, a profile, a plot).

Such a name may be anything: ``~someone`` with no such user, a name longer than the file system
allows, a NUL byte. Each of those names no file, and must come back as one more problem in the
file's list, not as a traceback (``pathlib`` raises RuntimeError, OSError and ValueError there).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from testbed.errors import InputError


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


def output_problem(path: Path) -> str | None:
    """Why a command could not write its output file at ``path`` (None when it can), asked
    before the command does its work: a phone's measurement takes minutes, and a name found
    wrong only at the end would lose them. Missing parent directories are fine (they are made).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, a file in the way
        return f"cannot be a file name: {getattr(exc, 'strerror', None) or exc}"
    if mode is not None and stat.S_ISDIR(mode):
        return "is a directory; expected a file name"
    if mode is not None and not stat.S_ISREG(mode):
        # a device or a FIFO: the new file would be renamed over it (written whole, below)
        return "exists and is not a regular file; expected a file name"
    # The one sure test is to make there what written_whole will make (os.access says yes to
    # root on /proc and /sys): a file beside path, or where its directory is still missing
    # (written_whole makes it), a directory in the nearest one that exists.
    parent = path.absolute().parent
    if parent.exists():
        try:
            _temporary_beside(path).unlink()
        except OSError as exc:
            return f"cannot create a file in {parent}: {exc.strerror}"
        return None
    while not parent.exists():
        parent = parent.parent
    probe = parent / f".testbed-probe.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a directory in {parent}: {exc.strerror}"
    probe.rmdir()
    return None


def _temporary_beside(path: Path) -> Path:
    """A new, empty file in ``path``'s directory, named after it (hidden), opened as a plain
    open() would (the umask applies, unlike mkstemp's 0600), and closed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return tmp


def checked_output(name: str, option: str) -> Path:
    """The output file a command's ``option`` names, or InputError (exit 2) saying why no file
    can be written there (:func:`output_problem`)."""
    path = Path(name)
    problem = output_problem(path)
    if problem:
        raise InputError(f"{option} {name}", [problem])
    return path


@contextmanager
def written_whole(path: Path, binary: bool = False) -> Iterator[IO[Any]]:
    """A handle whose content replaces ``path`` only once all of it is written: it goes to a
    temporary file beside ``path`` that is then renamed over it. A write that fails (a full
    disk, an exception in the caller) leaves ``path`` as it was and no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(path)
    try:
        with open(tmp, "wb" if binary else "w", newline=None if binary else "") as handle:
            yield handle
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
