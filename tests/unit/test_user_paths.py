"""Files a user names: a FIFO, a device, a directory or an oversized file is refused with a
reason (never read for ever), a run directory that cannot be made is bad input (exit 2), and an
output file is checked before the command's work and then written whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.user_paths import output_problem, read_user_text, written_whole
from tests.conftest import closed_port

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


def test_a_name_no_file_can_have_on_the_command_line_exits_2(tmp_path: Path) -> None:
    """A symlink loop as --churn (Path.resolve raised RuntimeError: a traceback, exit 1) and a
    run directory whose name is too long for the file system (OSError from exists())."""
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    cases = [(["simulate", str(REPO / "topologies/default.yaml"), "--churn",
               str(tmp_path / "loop-a"), "--out", str(tmp_path / "runs")],
              "Too many levels of symbolic links"),
             (["report", str(tmp_path / ("a" * 300))], "cannot read it: File name too long")]
    for argv, said in cases:
        proc = subprocess.run([sys.executable, "-m", "testbed.cli", *argv], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and said in proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


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


# Output files: checked before the command's work, written whole or not at all.

def test_output_problem_names_what_no_file_can_be_written_to(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "a-file").write_text("x")
    assert output_problem(tmp_path) == "is a directory; expected a file name"
    assert output_problem(tmp_path / "fifo") == ("exists and is not a regular file; expected a "
                                                 "file name")
    for no_name in (tmp_path / "a-file" / "out.csv", tmp_path / ("n" * 300)):
        assert (output_problem(no_name) or "").startswith("cannot be a file name: "), no_name
    # os.access would say yes to root here; the probe file says no
    assert (output_problem(Path("/proc/out.csv")) or "").startswith("cannot create a file in /proc")
    assert (output_problem(Path("/proc/new/out.csv")) or "").startswith(
        "cannot create a directory in /proc")


def test_output_problem_accepts_new_and_existing_files_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "old.csv").write_text("kept\n")
    assert output_problem(tmp_path / "new.csv") is None
    assert output_problem(tmp_path / "old.csv") is None
    assert output_problem(tmp_path / "sub" / "dir" / "new.csv") is None  # made when written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]  # no probe left behind
    assert (tmp_path / "old.csv").read_text() == "kept\n"


def test_written_whole_replaces_the_file_only_once_complete(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "trace.csv"
    with written_whole(path) as handle:
        handle.write("a\r\nb\n")
    assert path.read_bytes() == b"a\r\nb\n"  # written as given: csv's own line ends kept
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would, not mkstemp's 0600
    with pytest.raises(RuntimeError, match="half way"):
        with written_whole(path) as handle:
            handle.write("new content, never finished")
            raise RuntimeError("half way")
    assert path.read_bytes() == b"a\r\nb\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["trace.csv"]
    with written_whole(tmp_path / "plot.png", binary=True) as handle:
        handle.write(b"\x89PNG\r\n")
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG\r\n"


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "testbed.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_an_output_option_naming_a_directory_exits_2_before_any_work(
        tmp_path: Path) -> None:
    """Each command that writes a file at the user's word refuses a name no file can have
    before it starts: adb measure before it asks the adb server anything (here there is none,
    so an error about the server would show the order wrong), trace gen before it writes."""
    out = tmp_path / "out"
    out.mkdir()
    topology = str(REPO / "topologies/default.yaml")
    commands = {
        "-o": ["trace", "gen", "--topology", topology, "--duration", "100s",
               "--session-mean", "50s", "--absence-mean", "20s", "-o", str(out)],
        "--plot": ["trace", "show", str(REPO / "traces/flaky-phones.csv"), "--topology",
                   topology, "--plot", str(out)],
        "--out": ["adb", "measure", "emulator-5554", "--adb", f"127.0.0.1:{closed_port()}",
                  "--out", str(out)],
    }
    for option, argv in commands.items():
        proc = _cli(argv, tmp_path)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert f"{option} {out}" in proc.stderr and "is a directory" in proc.stderr, proc.stderr
    proc = _cli(["perf", "import", "ncnn", str(REPO / "README.md"), "--out", "/proc/x.csv"],
                tmp_path)
    assert proc.returncode == 2 and "cannot create a file in /proc" in proc.stderr, proc.stderr
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_profile_file_over_its_limit_is_refused_unparsed(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.perf_model import profiles
    path = tmp_path / "huge.yaml"
    path.write_text("# padding\n" * 20)
    monkeypatch.setattr(profiles, "MAX_PROFILE_BYTES", 100)
    with pytest.raises(profiles.ProfileError, match="larger than the 100 bytes"):
        profiles.load_profile(str(path))
