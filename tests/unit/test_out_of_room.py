"""A full disk mid-run: one line and exit 1, the files written before kept, no temporary file
left beside them. (On a 300 KB tmpfs, `testbed simulate topologies/default.yaml` filled it while
writing summary.json and had left a torn temporary file and a traceback.)"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.runlog import write_json_atomic

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "tiny.yaml"


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"state": "running"})

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        write_json_atomic(path, {"state": "done"})
    assert json.loads(path.read_text()) == {"state": "running"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_full_disk_is_one_line_and_exit_1_with_the_steps_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import testbed.report

    def full(_run_dir: Path) -> list[Path]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(testbed.report, "make_report", full)
    assert main(["simulate", str(TINY), "--steps", "2", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: No space left on device while writing; the files written before are kept" \
        in err and "Traceback" not in err, err
    (run_dir,) = tmp_path.iterdir()
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == 2
    assert json.loads((run_dir / "summary.json").read_text())["steps_done"] == 2


def test_other_os_errors_still_show_where_they_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import testbed.report

    def broken(_run_dir: Path) -> list[Path]:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(testbed.report, "make_report", broken)
    with pytest.raises(OSError, match="Input/output error"):
        main(["simulate", str(TINY), "--steps", "1", "--out", str(tmp_path)])


class _FullFile:
    def write(self, _text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        pass


def test_the_ps_runlog_keeps_the_first_write_error_and_drops_the_rest(tmp_path: Path) -> None:
    from testbed.runlog import RunLog

    strict = RunLog(tmp_path, started_s=0.0)
    strict._files["events"] = _FullFile()  # type: ignore[assignment]
    with pytest.raises(OSError):
        strict.event("join", device="phones-0")

    log = RunLog(tmp_path, started_s=0.0, strict=False)  # the PS's: its handlers go on
    log.event("join", device="phones-0")
    log._files["events"] = _FullFile()  # type: ignore[assignment]
    log.event("leave", device="phones-0")
    log.step(step=0)  # dropped too: the run is failing on the first error
    assert isinstance(log.write_error, OSError) and log.write_error.errno == errno.ENOSPC
    log.close()
    assert [json.loads(line)["event"] for line in
            (tmp_path / "events.jsonl").read_text().splitlines()] == ["join"]
    assert (tmp_path / "steps.jsonl").read_text() == ""
