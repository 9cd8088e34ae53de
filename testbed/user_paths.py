"""Files a user names: paths inside a user's files (a topology's profile and data files),
reading a user's text file (a topology, a churn trace) with a limit, parsing a user's YAML or
JSON text (:func:`load_user_yaml`, :func:`load_user_json`), and writing the file a command's
``--out`` or ``-o`` names (a measurement CSV, a trace, a profile, a plot), never over a file the
command reads (:func:`checked_output`).

Such a name may be anything: ``~someone`` with no such user, a name longer than the file system
allows, a NUL byte. Each of those names no file, and must come back as one more problem in the
file's list, not as a traceback (``pathlib`` raises RuntimeError, OSError and ValueError there).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import yaml

from testbed.errors import InputError

# Deeper nesting than this is no file of ours: the parsers recurse once per level, and Python's
# stack ends near a thousand (a 1.2 KB line of brackets raised RecursionError).
MAX_NESTING = 100
# a YAML document's values, each alias counted as a copy of what it names: the largest valid
# topology or profile has about a thousand
MAX_EXPANDED_VALUES = 100_000
READ_CHUNK_BYTES = 1 << 20  # read_user_text's pieces beyond a file's size as fstat gave it


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
    """A user's text file, whole (UTF-8, a leading byte order mark dropped, ``errors`` as for
    bytes.decode). Raises OSError, its
    ``strerror`` saying why, when the file cannot be read, is not a regular file (a FIFO or a
    device such as /dev/zero would block or never end) or holds more than ``max_bytes``;
    UnicodeDecodeError when it is not text.

    Memory is taken for what the file holds, never for ``max_bytes``: a limit of 4 GiB (a run's
    files, ``testbed.report``) read as ``f.read(max_bytes + 1)`` asked for a 4 GiB buffer up
    front, a MemoryError under ``ulimit -v`` or ``vm.overcommit_memory=2``. The size is checked
    with fstat before reading, and reads ask for that size (or ``READ_CHUNK_BYTES``) at a time, so
    a file that grows while it is read still stops at the limit."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file" + (
            " (a directory)" if stat.S_ISDIR(mode) else ""), str(path))
    too_big = OSError(errno.EFBIG, f"larger than the {max_bytes:,} bytes such a file may have",
                      str(path))
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size  # (0 for /proc's files: they are read in pieces)
        if size > max_bytes:
            raise too_big
        pieces, total = [], 0
        while total <= max_bytes:  # usually one read of it all, then the end
            piece = f.read(min(max(size + 1 - total, READ_CHUNK_BYTES), max_bytes + 1 - total))
            if not piece:
                break
            pieces.append(piece)
            total += len(piece)
    if total > max_bytes:
        raise too_big
    # utf-8-sig: a spreadsheet's "CSV UTF-8" export starts with a byte order mark, which would
    # otherwise become part of the first header name (or the first key)
    return b"".join(pieces).decode("utf-8-sig", errors)


def path_arg(text: str) -> str:
    """An argparse type: a path, never empty. `--churn ''` ran without the trace (or with the
    topology's), `--out ''` made the run directory in the working directory: an empty value
    is a shell variable that was not set, not a choice."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def input_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as an input file (None when it is a regular file): missing,
    a directory, or another kind of file (a FIFO or a device would block or never end)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"no such file: {path}"
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, a file in the way
        return f"{path}: cannot be a file name: {getattr(exc, 'strerror', None) or exc}"
    if stat.S_ISDIR(mode):
        return f"{path} is a directory; expected a file"
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file (a FIFO or a device); expected a file"
    return None


def same_file(a: Path, b: Path) -> bool:
    """Whether two names name one file: the same file when both exist (a symlink to it, a hard
    link, ``./x`` for ``x``: os.path.samefile), else the same path once made absolute and its
    symlinks and ``..`` resolved. False where either is a name no file can have."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # one of them is missing, or no file can have its name
        pass
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return False


def output_problem(path: Path, inputs: Iterable[tuple[str, str | Path | None]] = ()
                   ) -> str | None:
    """Why a command could not write its output file at ``path`` (None when it can), asked
    before the command does its work: a phone's measurement takes minutes, and a name found
    wrong only at the end would lose them. Missing parent directories are fine (they are made).

    ``inputs`` are the files the command reads, each with the argument that named it
    (``[("measurements", "m.csv")]``; None or empty: not given): an output that is one of them
    (:func:`same_file`) would replace what the command reads, so ``perf fit m.csv --out m.csv``
    lost its measurements and ``trace show s.csv --plot s.csv`` made the trace a PNG.
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
    for argument, given in inputs:
        if given and same_file(path, Path(given)):
            return (f"is the command's input {argument} {given}; expected another file name "
                    f"(writing it would destroy that input)")
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


def temporary_names(name_pattern: str) -> re.Pattern[str]:
    """The names :func:`written_whole` gives its temporaries for files whose names match the
    regex ``name_pattern``: hidden, the writer's pid, 8 random hex digits. A process killed
    before its rename leaves one; whoever owns the directory may match and remove them (the
    PS's checkpoints: ``engine.checkpoint.remove_stale_temporaries``)."""
    return re.compile(rf"\.(?:{name_pattern})\.\d+-[0-9a-f]{{8}}")


def _temporary_beside(path: Path) -> Path:
    """A new, empty file in ``path``'s directory, named after it (hidden, :func:`temporary_names`),
    opened as a plain open() would (the umask applies, unlike mkstemp's 0600), and closed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return tmp


def checked_output(name: str, option: str,
                   inputs: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """The output file a command's ``option`` names, or InputError (exit 2) saying why no file
    can be written there, ``inputs`` (the files the command reads) included
    (:func:`output_problem`)."""
    path = Path(name)
    problem = output_problem(path, inputs)
    if problem:
        raise InputError(f"{option} {name}", [problem])
    return path


@contextmanager
def written_whole(path: Path, binary: bool = False, durable: bool = False) -> Iterator[IO[Any]]:
    """A handle whose content replaces ``path`` only once all of it is written: it goes to a
    temporary file beside ``path`` (:func:`temporary_names`) that is then renamed over it. A
    write that fails (a full disk, an exception in the caller) leaves ``path`` as it was and no
    temporary file. ``durable`` also survives a power cut: the data is fsync'ed before the
    rename and the directory after it (the PS's checkpoints and its rewritten ``steps.jsonl``;
    a report or a plot can be made again, and an fsync costs the slow disks milliseconds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(path)
    try:
        with open(tmp, "wb" if binary else "w", newline=None if binary else "") as handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself
        finally:
            os.close(directory)


class _UserYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (YAML requires unique keys;
    PyYAML keeps the last one, so ``steps: 3`` written twice would silently lose the first)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_NESTING:
                raise yaml.MarkedYAMLError(None, None, f"nested more than {MAX_NESTING} levels "
                                           "deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, _ in node.value:  # before merge keys (<<) are flattened in
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} written twice in one mapping (first "
                        f"on line {first_line[key]}); keys must be unique", key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_user_yaml(text: str) -> Any:
    """A user's YAML document, safely: yaml.YAMLError (with the line where it can) for text that
    is not YAML, a key written twice in one mapping, nesting deeper than MAX_NESTING, or
    aliases that expand to more than MAX_EXPANDED_VALUES values."""
    loader = _UserYamlLoader(text)  # a SafeLoader: no Python objects
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it beyond MAX_EXPANDED_VALUES values. An alias
    is one node however often it is used, so 884 bytes of nested aliases (eight levels of ten)
    load as a few objects and become 10⁸ values only when walked: every error message that
    showed such a value, and anything that copies it, ran for seconds and printed hundreds of
    MB. Counted on the composed nodes (each node once, its expanded size from its children's);
    a node among its own descendants (``&a [*a]``) counts as one value there."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if children_done:
            open_nodes.discard(id(node))
            size[id(node)] = 1 + sum(size.get(id(c), 1) for c in children)
            if size[id(node)] > MAX_EXPANDED_VALUES:
                raise yaml.MarkedYAMLError(
                    None, None, f"more than {MAX_EXPANDED_VALUES:,} values here, each alias "
                    "counted as a copy of what its anchor names", node.start_mark)
            continue
        if id(node) in size or id(node) in open_nodes:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size and id(c) not in open_nodes)


def load_user_json(text: str) -> Any:
    """A user's JSON value: json.JSONDecodeError for text that is not JSON, and for what the
    decoder itself cannot take (nesting deep enough to end Python's stack, an integer of more
    digits than Python converts)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # int digits over sys.get_int_max_str_digits()
        raise json.JSONDecodeError(str(exc), text, 0) from None
