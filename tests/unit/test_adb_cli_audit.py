"""`testbed adb devices|doctor|measure` as a new user runs them, on the fake adb server.

What a user hit: no adb server was "connection refused" with no word on how to start one; a
serial the server does not list gave no hint of the ones it does; ``--out ""`` fell back to the
default file and measured; a ``--phone-port`` out of range read "expected 1 to 65,533"; the
help did not say what ``--limit 0``, ``--size`` or the defaults of ``--repeats`` and
``--passes`` are; a sweep of minutes and the doctor's waits said nothing until they ended; the
CSV of a ``--limit`` sweep was labelled as the whole ``--size`` sweep.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Iterator

import pytest

from testbed.adb_bridge import client
from testbed.adb_bridge import doctor as adb_doctor
from testbed.cli import main
from testbed.perf_model.measure import SWEEPS
from tests.fakes.adb_phones import recorded_phone
from tests.fakes.fake_adb import FakeAdbServer, FakePhone, ShellResult

RUN = "sh /data/local/tmp/testbed/run-python.sh /data/local/tmp/testbed/time_gemm.py "
DESCRIBE = b'{"cpu_model": "Qualcomm SM8350", "numpy": "1.26.0"}\n'


@pytest.fixture
def fake_adb() -> Iterator[FakeAdbServer]:
    with FakeAdbServer() as server:
        yield server


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: no adb server there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def adb(server: FakeAdbServer, *argv: str) -> int:
    return main(["adb", *argv, "--adb", f"127.0.0.1:{server.port}"])


def timing_phone(serial: str = "M1", repeats: int = 1) -> FakePhone:
    """A phone whose timing script answers at once, ``repeats`` samples of 1 ms."""
    samples = json.dumps({"samples": [0.001] * repeats}).encode() + b"\n"

    def hook(phone: FakePhone, command: str) -> ShellResult | None:
        if command.startswith(RUN + "describe"):
            return ShellResult(stdout=DESCRIBE)
        if command.startswith(RUN):
            return ShellResult(stdout=samples)
        return None

    return recorded_phone(serial, exec_hook=hook)


@pytest.mark.parametrize("command", [["devices"], ["measure", "M1"]])
def test_no_adb_server_says_how_to_start_one(command: list[str], closed_port: int,
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    """It said `error: adb server at 127.0.0.1:P: connect to adb server failed: ...`, and
    not what to do; the doctor's fix did."""
    argv = ["adb", *command, "--adb", f"127.0.0.1:{closed_port}"]
    if command[0] == "measure":
        argv += ["--out", str(tmp_path / "m.csv")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the adb server at 127.0.0.1:{closed_port} (")
    assert "start one with `adb start-server`" in err and "ANDROID_ADB_SERVER_ADDRESS" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "m.csv").exists()


def test_doctor_without_a_server_gives_the_same_fix(closed_port: int) -> None:
    from testbed.adb_bridge.server_address import START_SERVER_FIX

    d = adb_doctor.Doctor(client.AdbServer("127.0.0.1", closed_port), serial="X")
    assert not d.run()
    assert f"fix: {START_SERVER_FIX}" in d.report()


def test_an_unknown_serial_lists_the_phones_the_server_has(
        fake_adb: FakeAdbServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`measure P9` (a typo of P1) said only "P9 is not connected"."""
    fake_adb.plug(recorded_phone("P1"))
    fake_adb.plug(recorded_phone("P2", state="unauthorized"))
    assert adb(fake_adb, "measure", "P9", "--out", str(tmp_path / "m.csv")) == 1
    err = capsys.readouterr().err
    assert err == (f"error: phone P9 is not connected to the adb server at 127.0.0.1:"
                   f"{fake_adb.port}, which lists P1 (device), P2 (unauthorized)\n")
    report = adb_doctor.Doctor(client.AdbServer("127.0.0.1", fake_adb.port), serial="P9")
    report.run()
    assert "[FAIL] phone: P9 is not connected to the adb server" in report.report()
    assert "which lists P1 (device), P2 (unauthorized)" in report.report()
    assert "or name a phone the server lists" in report.report()


def test_measure_names_the_doctor_command_to_run(
        fake_adb: FakeAdbServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "`testbed adb doctor` says what to do": without the serial the doctor fails on
    a server with several phones, and without --adb it asks another server."""
    fake_adb.plug(recorded_phone("P1"))
    fake_adb.plug(recorded_phone("P2", state="unauthorized"))
    assert adb(fake_adb, "measure", "P2", "--out", str(tmp_path / "m.csv")) == 1
    err = capsys.readouterr().err
    assert f"`testbed adb doctor P2 --adb 127.0.0.1:{fake_adb.port}` says what to do" in err


def test_measure_refuses_an_empty_out(closed_port: int, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`--out ""` fell back to adb_measurements-SERIAL.csv and measured."""
    monkeypatch.chdir(tmp_path)
    assert main(["adb", "measure", "M1", "--out", "", "--adb",
                 f"127.0.0.1:{closed_port}"]) == 2
    assert "argument --out: expected a path, got an empty string" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["devices", "doctor", "measure"])
@pytest.mark.parametrize("port", ["0", "65534", "7e3", "-1", "70000"])
def test_phone_port_out_of_range_names_the_range(command: str, port: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """It read "expected 1 to 65,533, got 65,534": a port with a thousands separator, and no
    word on why not 65535."""
    assert main(["adb", command, "--phone-port", port]) == 2
    err = capsys.readouterr().err
    assert (f"argument --phone-port: expected a TCP port from 1 to 65533 (the doctor's probe "
            f"uses it + 1 and the Termux listener it + 2), got '{port}'") in err


def test_help_says_the_defaults_and_the_placeholders(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    assert main(["adb", "measure", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for said in ("--adb HOST:PORT", "[SERIAL]", "--limit N", "--out FILE", "--phone-port PORT",
                 "default 0: all of them", "(default 5;", "1 to 1000 (default 2)",
                 "element type of the matrices (default float32)",
                 f"quick {SWEEPS['quick']} shapes, full {SWEEPS['full']} shapes",
                 "a failed or interrupted sweep writes nothing", "exit codes: 0 done; 1"):
        assert said in text, said
    assert main(["adb", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "`adb start-server` runs one" in text and "2 a bad command line" in text
    assert main(["adb", "devices", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "No server there: start one with `adb start-server`" in text
    assert "the phone port whose `adb reverse` rule the REVERSE column shows" in text


def test_no_phones_says_what_to_do(fake_adb: FakeAdbServer,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert adb(fake_adb, "devices") == 0
    assert capsys.readouterr().out == (f"no phones on the adb server at 127.0.0.1:"
                                       f"{fake_adb.port}: plug one in and turn on USB "
                                       f"debugging (`testbed adb doctor` says what is "
                                       f"missing)\n")


def test_measure_logs_its_progress(fake_adb: FakeAdbServer, tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    """A sweep of 150 shapes x 2 passes, minutes on a phone, said nothing until it ended."""
    caplog.set_level(logging.INFO, logger="testbed.perf_model.measure")
    fake_adb.plug(timing_phone())
    assert adb(fake_adb, "measure", "M1", "--limit", "3", "--repeats", "1", "--passes", "2",
               "--out", str(tmp_path / "m.csv")) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "testbed.perf_model.measure"
             and not r.getMessage().startswith("measured ")]  # the sweep's own last log line
    assert lines[0] == "measuring 3 shape(s) x 2 pass(es) on M1: 6 timings, each within 70 s"
    assert lines[1].startswith("1/6 timed (pass 1/2), ")  # how long one takes
    assert lines[-1].startswith("6/6 timed (pass 2/2), ") and "left" not in lines[-1]
    assert any(line.startswith("3/6 timed (pass 1/2), ") for line in lines)  # a pass's end


def test_sweep_progress_is_at_most_one_line_per_interval() -> None:
    from testbed.perf_model.measure import SweepProgress

    now = [0.0]
    said: list[str] = []
    progress = SweepProgress(100, 2, every_s=10.0, say=said.append, clock=lambda: now[0])
    progress.start("measuring 100 shape(s) x 2 pass(es) on M1: 200 timings, each within 90 s")
    for _ in range(200):  # one timing a second
        now[0] += 1.0
        progress()
    assert said[0] == "measuring 100 shape(s) x 2 pass(es) on M1: 200 timings, each within 90 s"
    assert said[1] == "1/200 timed (pass 1/2), 1 s, about 199 s left"
    assert "100/200 timed (pass 1/2), 100 s, about 100 s left" in said
    assert said[-1] == "200/200 timed (pass 2/2), 200 s"
    assert len(said) == 2 + 200 // 10  # the start, the first, then one per 10 s


def test_a_limited_sweep_is_labelled_so_in_the_csv(fake_adb: FakeAdbServer,
                                                   tmp_path: Path) -> None:
    """The comment said `--size quick` for 2 shapes of it: read later, the whole sweep."""
    fake_adb.plug(timing_phone())
    out = tmp_path / "m.csv"
    assert adb(fake_adb, "measure", "M1", "--limit", "2", "--repeats", "1", "--passes", "1",
               "--seed", "7", "--out", str(out)) == 0
    first = out.read_text().splitlines()[0]
    assert first == (f"# testbed adb measure M1 --size quick: Qualcomm SM8350, "
                     f"numpy-1.26.0-phone; the first 2 of its {SWEEPS['quick']} shapes; seed 7")
    # the phone's numpy lets its BLAS pick the threads (0): the rows said "0 thread(s)"
    rows = [line for line in out.read_text().splitlines() if not line.startswith("#")][1:]
    assert rows and all(", its BLAS's own thread count, " in row for row in rows), rows


def test_doctor_says_each_check_as_it_ends(fake_adb: FakeAdbServer) -> None:
    """The report came only at the end, after waits of up to minutes (the probe, the join)."""
    fake_adb.plug(recorded_phone("P1"))
    seen: list[tuple[str, int]] = []
    waits: list[str] = []
    d = adb_doctor.Doctor(client.AdbServer("127.0.0.1", fake_adb.port), serial="P1")
    d.on_check = lambda check: seen.append((check.name, len(d.checks)))
    d.on_wait = waits.append
    d.run()
    # each check handed on as it was added, not at the end
    assert seen == [(c.name, i + 1) for i, c in enumerate(d.checks)]
    assert [name for name, _ in seen][:3] == ["adb server", "phone", "android"]
    assert waits[0] == "asking the adb shell's python for numpy and grpc (up to 60 s)"


def test_doctor_command_prints_the_report(fake_adb: FakeAdbServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake_adb.plug(recorded_phone("P2", state="unauthorized"))
    assert adb(fake_adb, "doctor", "P2") == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[ok] adb server: 127.0.0.1:")
    assert out[1] == ("[FAIL] phone: P2 is unauthorized: USB debugging is not allowed yet on "
                      "the phone")
    assert out[2].startswith("       fix: unlock the phone")
    assert out[3:] == ["the phone cannot compute tiles"]
