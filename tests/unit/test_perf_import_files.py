"""`testbed perf import --help` names the file of ../shared/data each source reads: each one
imports (the help named none, and the mnn and ncnn folders hold files the importer refuses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from testbed.perf_model.cli import IMPORT_FILES
from testbed.perf_model.importers import shared_data_dir

SHARED = shared_data_dir()  # the one rule: $TESTBED_SHARED_DATA, else the nearest ancestor's


@pytest.mark.skipif(SHARED is None, reason="no shared/data above the checkout and "
                    "TESTBED_SHARED_DATA is not set")
@pytest.mark.parametrize("source", sorted(IMPORT_FILES))
def test_each_source_imports_the_file_its_help_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str) -> None:
    assert SHARED is not None
    src = SHARED / IMPORT_FILES[source].split(" ")[0]
    out = tmp_path / f"{source}.csv"
    assert main(["perf", "import", source, str(src), "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert f"rows from {source}" in capsys.readouterr().out and out.stat().st_size > 0


def test_the_help_lists_every_source_with_its_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["perf", "import", "--help"]) == 0
    text = capsys.readouterr().out
    for source, file in IMPORT_FILES.items():
        assert f"  {source:<12} {file}" in text, text


@pytest.mark.parametrize("argv", [["perf"], *([["perf", c] for c in (
    "measure", "import", "fit", "eval", "calibrate", "predict", "show")])])
def test_every_perf_command_says_what_it_does_in_its_help(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    # `perf --help` and `perf measure --help` (and five more) printed usage and options alone
    from testbed.cli import build_parser

    parser = build_parser()
    for name in argv:
        parser = next(a for a in parser._actions if a.dest in ("command", "perf_command")
                      ).choices[name]  # type: ignore[index]
    assert parser.description, argv
