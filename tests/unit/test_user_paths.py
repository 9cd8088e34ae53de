"""Files a user names: a FIFO, a device, a directory or an oversized file is refused with a
reason (never read for ever), and a run directory that cannot be made is bad input (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.user_paths import read_user_text

REPO = Path(__file__).resolve().parents[2]


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("name: é\r\n")
    assert read_user_text(path, 100) == "name: é\r\n"
    assert read_user_text(path, len("name: é\r\n".encode())) == "name: é\r\n"  # at the limit


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_what_is_not_a_regular_file_is_refused_unread(tmp_path: Path, kind: str) -> None:
    path = {"device": Path("/dev/zero"), "directory": tmp_path}.get(kind, tmp_path / "fifo")
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block until a writer came
    with pytest.raises(OSError, match="not a regular file"):
        read_user_text(path, 1 << 20)


def test_a_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.csv"
    path.write_bytes(b"x" * 101)
    with pytest.raises(OSError, match="larger than the 100 bytes"):
        read_user_text(path, 100)


def test_a_fifo_or_device_named_on_the_command_line_exits_2_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "topology.yaml"
    os.mkfifo(fifo)
    for argv in (["validate", str(fifo)], ["trace", "show", "/dev/zero"],
                 ["simulate", str(REPO / "topologies/default.yaml"), "--churn", str(fifo)]):
        proc = subprocess.run([sys.executable, "-m", "testbed.cli", *argv], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "not a regular file" in proc.stderr, (argv, proc.stderr)


def test_an_out_where_no_run_directory_can_be_made_is_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "runs"
    not_a_dir.write_text("a file, not a directory\n")
    code = main(["simulate", str(REPO / "topologies/default.yaml"), "--out", str(not_a_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--out {not_a_dir}" in err and "cannot create a run directory in it" in err, err
    assert not_a_dir.read_text() == "a file, not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
