"""What testbed up refuses of a file on its declared backend: validate names it as a note (the
file is valid, and testbed simulate runs it), up refuses it with exit 2 before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.cli import main

DEFAULT = Path(__file__).resolve().parents[2] / "topologies" / "default.yaml"


def _copy(tmp_path: Path, **edits: object) -> Path:
    raw = yaml.safe_load(DEFAULT.read_text())
    raw["network"]["backend"] = edits["backend"]
    if "strategy" in edits:
        raw["job"]["parallelism"]["strategy"] = edits["strategy"]
    if "listen" in edits:
        raw["network"]["ps"]["listen"] = edits["listen"]
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("edits,words", [
    ({"backend": "loopback", "strategy": "pipeline"},
     "job.parallelism.strategy: pipeline runs on the Mininet backend only"),
    ({"backend": "loopback", "strategy": "data-parallel"},
     "job.parallelism.strategy: data-parallel runs on the Mininet backend only"),
    ({"backend": "mininet", "listen": "127.0.0.1:50051"},
     "network.ps.listen (devices on other machines) works with the loopback backend only"),
])
def test_validate_notes_what_up_refuses_and_up_refuses_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edits: dict, words: str) -> None:
    path = _copy(tmp_path, **edits)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"note: {path}: testbed up would refuse it: {words}" in out, out
    runs = tmp_path / "runs"
    assert main(["up", str(path), "--no-live", "--out", str(runs)]) == 2
    assert f"error: {path}: {words}" in capsys.readouterr().err
    assert not runs.exists() or not any(runs.iterdir())  # nothing started


def test_a_file_up_runs_gets_no_note(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(_copy(tmp_path, backend="loopback"))]) == 0
    assert "note:" not in capsys.readouterr().out


def test_up_refuses_what_auto_chose_on_a_machine_with_mininet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`backend: auto` is checked once this machine has chosen (a declared backend only
    before): here it would choose Mininet, where network.ps.listen does not work."""
    import testbed.emulator.network.select as select

    chosen: list[str] = []

    def mininet_here(topology: object, capabilities: object = None) -> str:
        chosen.append("mininet")
        return "mininet"
    monkeypatch.setattr(select, "resolve_backend", mininet_here)
    path = _copy(tmp_path, backend="auto", listen="127.0.0.1:50051")
    runs = tmp_path / "runs"
    assert main(["up", str(path), "--no-live", "--out", str(runs)]) == 2
    assert chosen == ["mininet"]
    assert (f"error: {path}: network.ps.listen (devices on other machines) works with the "
            "loopback backend only; this run would use mininet") in capsys.readouterr().err
    assert not runs.exists() or not any(runs.iterdir())  # nothing started


def test_the_backend_is_chosen_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """make_network takes the backend testbed up chose: choosing again said a second time why
    `auto` fell back to loopback (the probe itself is cached, its warning was not)."""
    import testbed.emulator.network.select as select
    from testbed.emulator.network.loopback import LoopbackNetwork
    from testbed.topology import load_topology

    def chosen_again(topology: object, capabilities: object = None) -> str:
        raise AssertionError("resolve_backend called again")
    monkeypatch.setattr(select, "resolve_backend", chosen_again)
    topology = load_topology(_copy(tmp_path, backend="auto"))
    assert isinstance(select.make_network(topology, backend="loopback"), LoopbackNetwork)
    with pytest.raises(AssertionError, match="called again"):
        select.make_network(topology)  # the check can fail: without a choice it chooses
