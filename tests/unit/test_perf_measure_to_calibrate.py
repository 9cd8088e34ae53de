"""`testbed perf measure` and `testbed adb measure` write exactly what `perf calibrate` takes.

Both run for real (numpy timing here; the adb one through the fake adb server, which runs the
phone's timing script as a local process), then their files go straight into calibrate.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Iterator

import pytest

from testbed.adb_bridge.agent_package import PHONE_DIR
from testbed.cli import main
from testbed.perf_model.measurements import read_measurements
from testbed.perf_model.profiles import load_profile
from tests.fakes.adb_phones import recorded_phone
from tests.fakes.fake_adb import FakeAdbServer, FakePhone, LocalProcessCommand

SMALL_SHAPES = "m,k,n\n16,64,16\n32,128,32\n48,256,32\n64,256,64\n96,512,64\n"


def _calibrate_and_predict(measured: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["perf", "calibrate", "snapdragon888", str(measured), "--out", str(out)]) == 0
    profile = load_profile(str(out))
    assert profile.model is not None and profile.model.form == "rate"
    capsys.readouterr()
    rows = read_measurements(measured)
    shapes = out.parent / "shapes.csv"
    shapes.write_text("m,k,n\n" + "".join(f"{r.m},{r.k},{r.n}\n" for r in rows))
    assert main(["perf", "predict", str(out), "--shapes", str(shapes)]) == 0
    predicted = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(predicted) == len(rows)
    for r, p in zip(rows, predicted):
        # fitted on these very rows: a unit slip (ms for s, per batch) would be 1000x off;
        # a loaded machine's noise is well inside a factor of 3
        ratio = float(p["seconds"]) / r.seconds
        assert 1 / 3 < ratio < 3, (r, p)


def test_perf_measure_output_calibrates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shapes = tmp_path / "five.csv"
    shapes.write_text(SMALL_SHAPES)
    measured = tmp_path / "host.csv"
    assert main(["perf", "measure", "--shapes", str(shapes), "--passes", "3", "--repeats", "2",
                 "--min-sample-s", "1e-4", "--device", "this-host", "--out", str(measured)]) == 0
    rows = read_measurements(measured)
    assert [(r.m, r.k, r.n) for r in rows] == [(16, 64, 16), (32, 128, 32), (48, 256, 32),
                                               (64, 256, 64), (96, 512, 64)]
    _calibrate_and_predict(measured, tmp_path / "host-calibrated.yaml", capsys)


def test_perf_measure_rejects_a_bad_shapes_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    shapes = tmp_path / "bad.csv"
    shapes.write_text("m,k,n\n16,64,16\n32,-1,32\n")
    out = tmp_path / "never.csv"
    assert main(["perf", "measure", "--shapes", str(shapes), "--out", str(out)]) == 2
    assert "line 3: column 'k'" in capsys.readouterr().err and not out.exists()


@pytest.fixture
def fake_adb_server() -> Iterator[FakeAdbServer]:
    server = FakeAdbServer().start()
    yield server
    server.stop()  # also ends every local process a phone's shell started


def test_adb_measure_output_calibrates(fake_adb_server: FakeAdbServer, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "phone"

    def argv(phone: FakePhone, match: object) -> list[str]:
        return [sys.executable, str(root / PHONE_DIR.lstrip("/") / "time_gemm.py"),
                *match.group(1).split()]  # type: ignore[attr-defined]

    # one BLAS thread, as a phone agent computes: the timing script leaves the thread count to
    # the BLAS, and an all-cores OpenBLAS on a loaded 2-core CI machine ran the larger shapes
    # 10-16x slower than the small single-threaded ones (no model fits that, nor should it)
    hook = LocalProcessCommand(r"^sh /data/local/tmp/testbed/run-python\.sh \S+time_gemm\.py "
                               r"(.*)$", argv, wait=True,
                               env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    fake_adb_server.plug(recorded_phone("PHONE1", root_dir=root, exec_hook=hook))
    measured = tmp_path / "adb.csv"
    assert main(["adb", "measure", "PHONE1", "--adb", f"127.0.0.1:{fake_adb_server.port}",
                 "--limit", "4", "--repeats", "2", "--passes", "3",
                 "--out", str(measured)]) == 0
    rows = read_measurements(measured)
    assert len(rows) == 4 and {r.device for r in rows} == {"adb-phone1"}
    _calibrate_and_predict(measured, tmp_path / "phone-calibrated.yaml", capsys)
