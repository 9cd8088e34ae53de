"""An output file named by the user that is also one of the command's inputs is refused (exit 2)
before the command does anything, and the input is left as it was: `trace show s.csv --plot
s.csv` made the trace a PNG, `trace gen --topology t.yaml -o t.yaml` replaced the topology by a
trace, `perf fit m.csv --out m.csv` the measurements by a model, all with exit 0."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.perf_model.profiles import find_profile
from testbed.user_paths import output_problem, same_file

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "topologies" / "default.yaml"
MEASUREMENTS = ROOT / "tests" / "data" / "perf_host.csv"
SESSIONS = ROOT / "tests" / "data" / "churn" / "sessions.csv"
VFPBENCH_LOG = "Total:\n  SingleThread SP max: 10.5 GFLOPS\n  MultiThread SP max: 40.0 GFLOPS\n"
TRACE = "time_s,device,event,arg\n0,phones-0,leave,\n10,phones-0,join,\n"
GEN = ["--duration", "1min", "--session-mean", "10s", "--absence-mean", "5s"]


def _files(tmp_path: Path) -> dict[str, str]:
    """Every input a command below reads, copied into ``tmp_path`` (name -> path)."""
    paths = {"t.yaml": TOPOLOGY, "m.csv": MEASUREMENTS, "s.csv": SESSIONS}
    for name, source in paths.items():
        shutil.copy(source, tmp_path / name)
    (tmp_path / "trace.csv").write_text(TRACE)
    (tmp_path / "shapes.csv").write_text("m,k,n\n8,8,8\n")
    (tmp_path / "log.txt").write_text(VFPBENCH_LOG)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "phone.txt").write_text(VFPBENCH_LOG)
    (tmp_path / "behave.pkl").write_bytes(pickle.dumps(
        {f"c{i}": {"active": [0], "inactive": [50], "finish_time": 100} for i in range(3)}))
    base = find_profile("snapdragon888")
    assert base is not None
    shutil.copy(base, tmp_path / "base.yaml")
    return {p.name: str(p) for p in tmp_path.iterdir()} | {"logs/phone.txt":
                                                          str(tmp_path / "logs" / "phone.txt")}


# (argv with @name for the files of _files, the input it would overwrite, the argument
# naming that input in the message)
CASES = [
    (["trace", "show", "@trace.csv", "--topology", "@t.yaml", "--plot", "@trace.csv"],
     "trace.csv", "trace"),
    (["trace", "show", "@trace.csv", "--topology", "@t.yaml", "--plot", "@t.yaml"],
     "t.yaml", "--topology"),
    (["trace", "gen", "--topology", "@t.yaml", *GEN, "-o", "@t.yaml"], "t.yaml", "--topology"),
    (["trace", "import", "sessions", "@s.csv", "--topology", "@t.yaml", "-o", "@s.csv"],
     "s.csv", "source"),
    (["trace", "import", "fedscale", "@behave.pkl", "--topology", "@t.yaml", "-o",
      "@behave.pkl"], "behave.pkl", "source"),
    (["trace", "import", "sessions", "@s.csv", "--topology", "@t.yaml", "-o", "@t.yaml"],
     "t.yaml", "--topology"),
    (["perf", "calibrate", "snapdragon888", "@m.csv", "--out", "@m.csv"], "m.csv",
     "measurements"),
    (["perf", "calibrate", "@base.yaml", "@m.csv", "--out", "@base.yaml", "--name", "x"],
     "base.yaml", "base_profile"),
    (["perf", "fit", "@m.csv", "--out", "@m.csv"], "m.csv", "measurements"),
    (["perf", "import", "vfpbench", "@log.txt", "--out", "@log.txt"], "log.txt", "src"),
    (["perf", "import", "vfpbench", "@logs", "--out", "@logs/phone.txt"], "logs/phone.txt",
     "src"),
    (["perf", "measure", "--shapes", "@shapes.csv", "--passes", "1", "--repeats", "1",
      "--warmup", "0", "--out", "@shapes.csv"], "shapes.csv", "--shapes"),
]


@pytest.mark.parametrize("argv, overwritten, argument", CASES,
                         ids=[" ".join(c[0][:2]) + f" over {c[1]}" for c in CASES])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], overwritten: str,
        argument: str) -> None:
    files = _files(tmp_path)
    before = {name: Path(path).read_bytes() for name, path in files.items()
              if Path(path).is_file()}
    code = main([files[a[1:]] if a.startswith("@") else a for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"is the command's input {argument} {files[overwritten]}; expected another file " \
           "name" in err, err
    after = {name: Path(path).read_bytes() for name, path in files.items()
             if Path(path).is_file()}
    assert after == before  # nothing written, nothing lost
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for n in files if "/" not in n)  # no temporary or probe left


@pytest.mark.parametrize("spelling", ["./{}", "sub/../{}", "link-to-{}", "hard-{}"])
def test_another_name_of_the_input_is_caught(tmp_path: Path, spelling: str,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The same file under another name: `./m.csv`, a path through a directory, a symlink,
    a hard link."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(MEASUREMENTS, "m.csv")
    (tmp_path / "sub").mkdir()
    os.symlink("m.csv", "link-to-m.csv")
    os.link("m.csv", "hard-m.csv")
    before = Path("m.csv").read_bytes()
    assert main(["perf", "fit", "m.csv", "--out", spelling.format("m.csv")]) == 2
    assert "is the command's input measurements m.csv" in capsys.readouterr().err
    assert Path("m.csv").read_bytes() == before
    assert os.path.islink("link-to-m.csv")


def test_an_output_beside_the_input_is_still_written(tmp_path: Path) -> None:
    shutil.copy(MEASUREMENTS, tmp_path / "m.csv")
    assert main(["perf", "fit", str(tmp_path / "m.csv"), "--out", str(tmp_path / "m.yaml")]) == 0
    assert (tmp_path / "m.yaml").read_text().startswith("model:")


def test_output_problem_compares_with_each_input(tmp_path: Path) -> None:
    (tmp_path / "in.csv").write_text("x\n")
    inputs = [("--shapes", None), ("source", ""), ("trace", str(tmp_path / "in.csv"))]
    assert output_problem(tmp_path / "out.csv", inputs) is None
    assert output_problem(tmp_path / "in.csv", inputs) == (
        f"is the command's input trace {tmp_path / 'in.csv'}; expected another file name "
        "(writing it would destroy that input)")
    # neither exists yet: the same name once resolved is still the same file
    assert output_problem(tmp_path / "x" / ".." / "new.csv",
                          [("src", tmp_path / "new.csv")]) is not None


def test_same_file_without_the_files(tmp_path: Path) -> None:
    os.symlink("loop", tmp_path / "loop")
    assert not same_file(tmp_path / "loop", tmp_path / "other")
    assert same_file(tmp_path / "new", tmp_path / "." / "new")
