"""An empty path argument is refused by the parser (``user_paths.path_arg``), never taken as
``.``: inside a run directory `testbed clean ""` cleaned the current directory, `validate ""`
and `trace show ""` reported problems of `.`, `perf show ""` listed every profile."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from testbed.cli import build_parser, main
from testbed.user_paths import path_arg

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = str(ROOT / "topologies" / "default.yaml")
GEN = ["--duration", "1min", "--session-mean", "10s", "--absence-mean", "5s"]
FINGERPRINT = "sha256:" + "ab" * 32

EMPTY = [
    ["validate", ""],
    ["up", ""],
    ["up", "--resume", ""],
    ["clean", ""],
    ["trace", "show", ""],
    ["trace", "show", "t.csv", "--topology", ""],
    ["trace", "gen", "--topology", "", *GEN],
    ["trace", "gen", "--topology", TOPOLOGY, *GEN, "-o", ""],
    ["trace", "import", "sessions", "", "--topology", TOPOLOGY],
    ["trace", "import", "sessions", "s.csv", "--topology", ""],
    ["trace", "import", "sessions", "s.csv", "--topology", TOPOLOGY, "-o", ""],
    ["perf", "measure", "--shapes", "", "--passes", "1", "--repeats", "1", "--warmup", "0",
     "--out", "m.csv"],
    ["perf", "measure", "--out", ""],
    ["perf", "import", "mnn", "", "--out", "m.csv"],
    ["perf", "import", "mnn", "x.csv", "--out", ""],
    ["perf", "fit", "", "--out", "m.yaml"],
    ["perf", "fit", "m.csv", "--out", ""],
    ["perf", "eval", ""],
    ["perf", "calibrate", "", "m.csv", "--out", "p.yaml"],
    ["perf", "calibrate", "snapdragon888", "", "--out", "p.yaml"],
    ["perf", "calibrate", "snapdragon888", "m.csv", "--out", ""],
    ["perf", "predict", "", "8", "8", "8"],
    ["perf", "predict", "snapdragon888", "--shapes", ""],
    ["perf", "show", ""],
    ["adb", "measure", "SERIAL", "--out", ""],
    ["net", "check", ""],
    ["join", "127.0.0.1:9", "--fingerprint", FINGERPRINT, "--token-file", ""],
    ["join", "127.0.0.1:9", "--fingerprint", FINGERPRINT, "--profile", ""],
]


@pytest.mark.parametrize("argv", EMPTY, ids=[" ".join(a) for a in EMPTY])
def test_an_empty_path_is_refused_by_the_parser(argv: list[str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # what `.` would have been: left alone
    (tmp_path / "pids.json").write_text("{}\n")  # a run directory's, for `clean ""`
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "expected a path, got an empty string" in captured.err, captured.err
    assert captured.out == ""
    assert [p.name for p in tmp_path.iterdir()] == ["pids.json"]


# Arguments that take text but no path: each is listed, so that a new path argument without
# path_arg fails test_every_path_argument_is_a_path_arg until it is classified.
NOT_PATHS = {
    ("compare", "--strategies"), ("perf measure", "--device"), ("perf import", "--backend"),
    ("perf fit", "--device"), ("perf fit", "--backend"), ("perf eval", "--device"),
    ("perf eval", "--backend"), ("perf calibrate", "--device"), ("perf calibrate", "--backend"),
    ("perf calibrate", "--name"), ("perf predict", "mkn"), ("trace gen", "--groups"),
    ("adb devices", "--adb"), ("adb doctor", "--adb"), ("adb doctor", "serial"),
    ("adb measure", "--adb"), ("adb measure", "serial"), ("net check", "--devices"),
}


def _text_arguments() -> list[tuple[str, str, argparse.Action]]:
    """(command, argument, action) for every argument of every command that takes free text
    (no type, or path_arg; no choices)."""
    found: list[tuple[str, str, argparse.Action]] = []

    def walk(parser: argparse.ArgumentParser, command: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in dict.fromkeys(action.choices.items()):
                    walk(sub, [*command, name])
            elif (action.nargs != 0 and action.choices is None
                  and (action.type is None or action.type is path_arg)):
                found.append((" ".join(command), (action.option_strings or [action.dest])[-1],
                              action))
    walk(build_parser(), [])
    return found


def test_every_path_argument_is_a_path_arg() -> None:
    untyped = [(command, argument) for command, argument, action in _text_arguments()
               if action.type is not path_arg and (command, argument) not in NOT_PATHS]
    assert untyped == []
    typed = {(command, argument) for command, argument, action in _text_arguments()
             if action.type is path_arg}
    assert {("validate", "topology"), ("clean", "target"), ("trace show", "trace"),
            ("trace gen", "--topology"), ("perf show", "profile"),
            ("join", "--token-file")} <= typed


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_resume_of_no_directory_says_so_once(tmp_path: Path, kind: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`up --resume /nonexistent` said that topology.input.yaml and up.json were not found,
    two lines for a directory that is not there."""
    target = tmp_path / "run"
    if kind == "file":
        target.write_text("not a run\n")
    assert main(["up", "--resume", str(target)]) == 2
    err = capsys.readouterr().err
    what = "no such directory" if kind == "missing" else "not a directory"
    assert err == (f"error: --resume {target}: {what}; expected a run directory made by "
                   f"testbed up (runs/<time>-<name>/)\n"), err
    assert not target.is_dir()
