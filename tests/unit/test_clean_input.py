"""`testbed clean` as a user types it: what it says when there is nothing to list or clean, and
a target that is neither a run directory nor a prefix. Nothing here cleans anything real: the
run records and the cleaning are replaced, so no other run's network can be touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.cli import main
from testbed.emulator.network import cleanup


@pytest.fixture
def no_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """No recorded networks, in a state directory of the test's own; cleaning is recorded,
    never done."""
    cleaned: list[Any] = []
    monkeypatch.setattr(cleanup, "state_dir", lambda: tmp_path / "testbed-net")
    monkeypatch.setattr(cleanup, "run_records", lambda: [])

    def fake_clean(prefix: str | None = None) -> list[cleanup.Leftovers]:
        cleaned.append(prefix)
        return [] if prefix is None else [cleanup.Leftovers(prefix)]

    monkeypatch.setattr(cleanup, "clean", fake_clean)
    return cleaned


def test_list_with_no_records_says_so(no_records: list[Any], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clean", "--list"]) == 0
    assert capsys.readouterr().out == f"no recorded networks (none in {tmp_path}/testbed-net)\n"


def test_clean_with_nothing_to_clean_says_so(no_records: list[Any],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clean"]) == 0
    assert no_records == [None]
    assert capsys.readouterr().out.startswith(
        "nothing to clean: no recorded network whose owner is gone")


def test_list_with_a_target_is_refused(no_records: list[Any],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # it listed everything and ignored the target: the user meant one or the other
    assert main(["clean", "--list", "tbabc"]) == 2
    assert "error: --list lists every recorded network and takes no run directory or prefix " \
           "(got 'tbabc')" in capsys.readouterr().err
    assert not no_records


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_path_that_is_no_directory_is_said_plainly(
        no_records: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        kind: str) -> None:
    path = tmp_path / "runs" / "20261130-000000-x"
    if kind == "file":
        path = tmp_path / "afile"
        path.write_text("x")
    assert main(["clean", str(path)]) == 2
    err = capsys.readouterr().err
    what = "no such directory" if kind == "missing" else "not a directory"
    assert err.startswith(f"error: {path}: {what}; expected a run directory")
    assert "is not a run prefix" not in err  # a path was never meant as a prefix
    assert not no_records


def test_a_bad_prefix_is_said_once(no_records: list[Any],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clean", "tb-x!"]) == 2
    err = capsys.readouterr().err
    assert err.count("tb-x!") == 1
    assert "neither a run directory nor a network prefix (expected a directory made by " \
           "testbed up, or 'tb' and three characters from a-z0-9, like 'tbk3x')" in err
    assert not no_records


def test_a_prefix_is_still_cleaned(no_records: list[Any],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clean", "tbzzz"]) == 0
    assert no_records == ["tbzzz"]
    assert capsys.readouterr().out == "tbzzz: nothing left\n"


def test_a_run_dirs_prefix_now_of_a_live_run_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefixes are three random characters: once a killed run's record is gone, a later run
    may draw its prefix, and `testbed clean RUN_DIR` of the killed run removed that live run's
    hosts and links."""
    import json

    import psutil

    from testbed.emulator.network import cleanup

    monkeypatch.setattr(cleanup, "state_dir", lambda: tmp_path / "records")
    (tmp_path / "records").mkdir()
    me = psutil.Process()
    (tmp_path / "records" / "tbq9z.json").write_text(json.dumps(
        {"prefix": "tbq9z", "owner_pid": me.pid, "owner_create_time": me.create_time()}))
    removed: list[str] = []
    monkeypatch.setattr(cleanup, "remove_leftovers", lambda p: removed.append(p))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "network.json").write_text(json.dumps({"prefix": "tbq9z"}))
    lines = cleanup.clean_run_dir(run_dir)
    assert not removed, "a live run's network was removed"
    assert lines[-1] == (f"tbq9z: now the network of another run, which is running (owner pid "
                         f"{me.pid}); left alone")
