"""A command group named without one of its commands prints the group's help (exit 2)."""

from __future__ import annotations

import pytest

from testbed.cli import main


@pytest.mark.parametrize("argv, commands", [
    ([], ("validate", "up", "simulate", "report", "perf", "trace", "join")),
    (["-v"], ("validate", "up", "simulate")),
    (["perf"], ("measure", "import", "fit", "eval", "calibrate", "predict", "show")),
    (["trace"], ("gen", "show", "import")),
    (["adb"], ("devices", "doctor", "measure")),
    (["net"], ("check",)),
])
def test_a_bare_group_prints_what_its_commands_are(
        capsys: pytest.CaptureFixture[str], argv: list[str], commands: tuple[str, ...]) -> None:
    # `testbed` alone said "the following arguments are required: COMMAND" under one line of
    # usage, and nothing of the commands there are
    assert main(argv) == 2
    err = capsys.readouterr().err
    for command in commands:
        assert f"\n    {command} " in err, (command, err)
    assert err.rstrip().endswith("error: name one of the commands above"), err


@pytest.mark.parametrize("argv", [["validate"], ["perf", "predict"], ["trace", "show"]])
def test_a_command_missing_its_arguments_keeps_argparses_message(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "name one of the commands above" not in err and "error:" in err, err


def test_python_dash_m_testbed_is_the_command() -> None:
    """`python -m testbed` failed ("No module named testbed.__main__")."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "testbed", "validate", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: testbed validate" in done.stdout, done
