"""`testbed adb devices|doctor|measure` against phones that misbehave, on the fake adb server.

Each fault is what a real phone (or an app on it) can do: answer without shell protocol v2
(Android 6), never answer, trickle, close mid-answer, vanish between two requests, sit in a
state other than ``device``, print control characters or megabytes where a model name goes,
or answer the timing script and the doctor's probe port with something else than they print.
Every command must say which phone and which command, in one line, and go on with the others
where it can; ``adb measure`` never writes a file that testbed's own reader refuses.
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from testbed.adb_bridge import cli as adb_cli
from testbed.adb_bridge import client
from testbed.adb_bridge import doctor as adb_doctor
from testbed.cli import main
from testbed.perf_model.measurements import read_measurements
from tests.fakes.adb_phones import DATA, recorded_phone
from tests.fakes.fake_adb import FakeAdbServer, FakePhone, FakeTermux, ShellResult, free_port_base

RUN = "sh /data/local/tmp/testbed/run-python.sh /data/local/tmp/testbed/time_gemm.py "
DESCRIBE = b'{"cpu_model": "Qualcomm SM8350", "numpy": "1.26.0"}\n'
NO_PERMISSIONS = ("no permissions (user in plugdev group; are your udev rules wrong?); "
                  "see [http://developer.android.com/tools/device.html]")


class VanishingServer(FakeAdbServer):
    """The fake, where the phones in ``gone`` are listed but not found when asked: unplugged
    between ``host:devices`` and the next request."""

    gone: set[str] = set()

    def _find(self, conn: socket.socket, selector: str) -> FakePhone | None:
        if selector in self.gone:
            self._fail(conn, f"device '{selector}' not found")
            return None
        return super()._find(conn, selector)


@pytest.fixture
def fake_adb() -> Iterator[VanishingServer]:
    with VanishingServer() as server:
        server.gone = set()
        yield server


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of the test: lets a phone that 'never answers' go."""
    event = threading.Event()
    yield event
    event.set()


def adb(server: FakeAdbServer, *argv: str) -> int:
    return main(["adb", *argv, "--adb", f"127.0.0.1:{server.port}"])


def doctor(server: FakeAdbServer, serial: str, **kwargs: Any) -> adb_doctor.Doctor:
    d = adb_doctor.Doctor(client.AdbServer("127.0.0.1", server.port), serial=serial, **kwargs)
    d.run()
    return d


def devices_json(server: FakeAdbServer, capsys: pytest.CaptureFixture[str]
                 ) -> dict[str, dict[str, Any]]:
    assert adb(server, "devices", "--json") == 0
    return {r["serial"]: r for r in json.loads(capsys.readouterr().out)}


# -- 1. a phone without shell protocol v2 --------------------------------------------------------

def test_an_android_6_phone_without_shell_v2_shows_its_model_and_age(
        fake_adb: VanishingServer, capsys: pytest.CaptureFixture[str]) -> None:
    """adbd before Android 7 has no shell_v2: adbutils' shell2 left its stdout empty, so the
    phone read as blank (no model, no Android version, not 'too old')."""
    fake_adb.plug(recorded_phone("OLD6", getprop="getprop_old.txt", features="cmd"))
    fake_adb.plug(recorded_phone("NEW12", features="cmd"))
    assert adb(fake_adb, "devices") == 0
    table = capsys.readouterr().out
    old = next(line for line in table.splitlines() if line.startswith("OLD6"))
    assert "Budget Phone" in old and "Android 6.0.1 (API 23) is too old" in old
    assert "M2011K2G" in next(line for line in table.splitlines() if line.startswith("NEW12"))
    assert adb(fake_adb, "doctor", "OLD6") == 1
    report = capsys.readouterr().out
    assert ("[FAIL] android: Budget Phone, armeabi-v7a: Android 6.0.1 (API 23) is too old"
            in report)


# -- 2. deadlines ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_phone_whose_getprop_never_answers_costs_one_deadline(
        fake_adb: VanishingServer, release: threading.Event,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It waited adbutils' 600 s per read, then blamed the adb server for all phones."""
    def hang(phone: FakePhone, command: str) -> ShellResult | None:
        if command == "getprop":
            release.wait(20)
        return None

    monkeypatch.setattr(adb_cli, "GETPROP_TIMEOUT_S", 0.5, raising=False)
    fake_adb.plug(recorded_phone("GOOD1"))
    fake_adb.plug(recorded_phone("HUNG1", exec_hook=hang))
    started = time.monotonic()
    rows = devices_json(fake_adb, capsys)
    assert time.monotonic() - started < 5
    assert rows["GOOD1"]["model"] == "M2011K2G"
    assert rows["HUNG1"]["problem"] == "phone HUNG1: `getprop` did not finish in 0.5 s"

    started = time.monotonic()
    report = doctor(fake_adb, "HUNG1", shell_timeout_s=0.5).report()
    assert time.monotonic() - started < 5
    assert "[FAIL] adb shell: phone HUNG1: `getprop` did not finish in 0.5 s" in report
    assert "restart it" in report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["silent", "trickle"])
def test_measure_gives_each_shape_a_deadline_that_grows_with_the_samples(
        fault: str, fake_adb: VanishingServer, release: threading.Event, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A silent timing script took 121 s to fail (blaming the adb server); one that prints a
    byte now and then never failed: adbutils' timeout is per read."""
    def timing(phone: FakePhone, command: str) -> ShellResult | None:
        if command.startswith(RUN + "describe"):
            return ShellResult(stdout=DESCRIBE)
        if command.startswith(RUN) and fault == "silent":
            release.wait(20)
        if command.startswith(RUN):  # one byte every 0.1 s for 10 s
            return ShellResult(stdout=b" " * 100, trickle_s=0.1)
        return None

    monkeypatch.setattr(adb_cli, "MEASURE_START_S", 1.0, raising=False)
    monkeypatch.setattr(adb_cli, "MEASURE_PER_SAMPLE_S", 0.25, raising=False)
    fake_adb.plug(recorded_phone("M1", exec_hook=timing))
    started = time.monotonic()
    assert adb(fake_adb, "measure", "M1", "--limit", "1", "--repeats", "2", "--passes", "1",
               "--out", str(tmp_path / "m.csv")) == 1
    assert time.monotonic() - started < 6
    err = capsys.readouterr().err
    # 1 s + 0.25 s x (1 warm-up + 2 samples)
    assert err.startswith("error: phone M1: shape 48x64x16: `time_gemm.py 48 64 16 float32 1 2 "
                          "0.001` did not finish in 1.75 s"), err
    assert not (tmp_path / "m.csv").exists()


def test_measure_help_states_the_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["adb", "measure", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "within 60 s + 5 s per timed call" in text and "90 s by default" in text


# -- 3. one bad phone is one bad row ---------------------------------------------------------------

def test_devices_lists_the_others_when_one_phone_is_cut_off_or_gone(
        fake_adb: VanishingServer, capsys: pytest.CaptureFixture[str]) -> None:
    """A getprop cut mid-answer was an EOFError traceback; a phone gone between host:devices
    and its getprop failed the whole listing."""
    fake_adb.plug(recorded_phone("AAA1"))
    cut = fake_adb.plug(recorded_phone("CUT1"))
    cut.commands["getprop"] = ShellResult(stdout=b"[ro.product.model]: [Half", cut=True)
    fake_adb.plug(recorded_phone("GONE1"))
    fake_adb.plug(recorded_phone("ZZZ1"))
    fake_adb.gone = {"GONE1"}
    rows = devices_json(fake_adb, capsys)
    assert [rows[s]["model"] for s in ("AAA1", "ZZZ1")] == ["M2011K2G", "M2011K2G"]
    assert rows["CUT1"]["problem"] == ("phone CUT1: `getprop` ended without an exit status "
                                       "(the connection closed mid-answer)")
    assert "GONE1" in rows["GONE1"]["problem"] and "not found" in rows["GONE1"]["problem"]
    assert adb(fake_adb, "devices") == 0
    assert len(capsys.readouterr().out.splitlines()) == 5  # header + one line per phone


# -- 4. adb measure takes only what the timing script prints ---------------------------------------

def timing_phone(shape_answer: ShellResult, describe: bytes = DESCRIBE) -> FakePhone:
    def hook(phone: FakePhone, command: str) -> ShellResult | None:
        if command.startswith(RUN + "describe"):
            return ShellResult(stdout=describe)
        if command.startswith(RUN):
            return shape_answer
        return None

    return recorded_phone("M1", exec_hook=hook)


SAMPLES_EXPECTED = r'expected \{"samples": \[2 number\(s\) of seconds, each from 1e-09 to 75\]\}'


@pytest.mark.parametrize("answer, expected", [
    (ShellResult(stdout=b'[0.001, 0.0011]\n'), r"answered \[0.001, 0.0011\]; " + SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"error": "MemoryError"}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": null}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [[0.001], [0.001]]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": ["0.001", "0.001"]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [NaN, 0.001]}\n'),
     r'answered \{"samples": \[NaN, 0.001\]\}; ' + SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [Infinity, 0.001]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [1e400, 0.001]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [0, 0.001]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [-0.001, 0.001]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [true, true]}\n'), SAMPLES_EXPECTED),
    (ShellResult(stdout=b'{"samples": [1e-12, 0.001]}\n'), SAMPLES_EXPECTED),  # < any GEMM
    (ShellResult(stdout=b'{"samples": [0.001]}\n'), SAMPLES_EXPECTED),  # 1 of the 2 asked
    (ShellResult(stdout=b'{"samples": [1e6, 0.001]}\n'), SAMPLES_EXPECTED),  # > its deadline
    (ShellResult(stdout=b"[" * 100_000 + b"]" * 100_000 + b"\n"),
     r"`time_gemm.py 48 64 16 float32 1 2 0.001` printed .*; expected a line of JSON"),
    (ShellResult(stdout=b"\xff\xfe garbage\n"), r"printed .*garbage.*; expected a line of JSON"),
    (ShellResult(stdout=b""), r"printed nothing; expected a line of JSON"),
    (ShellResult(stdout=b'{"sam', cut=True),
     r"ended without an exit status \(the connection closed mid-answer\)"),
])
def test_measure_refuses_what_no_timing_script_prints(
        answer: ShellResult, expected: str, fake_adb: VanishingServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """NaN samples were written (exit 0, a file perf fit refuses); a list, null or a deep
    nesting was a traceback; the previous file must survive a failed sweep."""
    out = tmp_path / "m.csv"
    fake_adb.plug(timing_phone(ShellResult(stdout=b'{"samples": [0.001, 0.0011]}\n')))
    argv = ("measure", "M1", "--limit", "1", "--repeats", "2", "--passes", "1", "--out",
            str(out))
    assert adb(fake_adb, *argv) == 0
    good = out.read_text()
    capsys.readouterr()
    fake_adb.phones["M1"].exec_hook = timing_phone(answer).exec_hook
    assert adb(fake_adb, *argv) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: phone M1: shape 48x64x16: .*" + expected + r"\n", err), err
    assert out.read_text() == good


@pytest.mark.parametrize("describe", [b"[1, 2]\n", b'"hello"\n', b"null\n"])
def test_measure_refuses_a_describe_answer_that_is_not_an_object(
        describe: bytes, fake_adb: VanishingServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake_adb.plug(timing_phone(ShellResult(stdout=b'{"samples": [0.001]}\n'), describe))
    assert adb(fake_adb, "measure", "M1", "--out", str(tmp_path / "m.csv")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: phone M1: describing the phone: the timing script answered ")
    assert err.rstrip().endswith("expected a JSON object with cpu_model and numpy")


def test_measure_keeps_phone_text_on_one_line_of_the_csv(
        fake_adb: VanishingServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """cpu_model comes from the phone's /proc/cpuinfo: a newline in it split the comment
    header and the provenance field, and the file no longer read back."""
    cpu = "X\n1,2,3,4\n# x\x1b[31m\u2028" + "Y" * 10_000
    describe = json.dumps({"cpu_model": cpu, "numpy": "1.26\r\n0"}).encode() + b"\n"
    fake_adb.plug(timing_phone(ShellResult(stdout=b'{"samples": [0.001, 0.002]}\n'), describe))
    out = tmp_path / "m.csv"
    assert adb(fake_adb, "measure", "M1", "--limit", "2", "--repeats", "2", "--passes", "1",
               "--out", str(out)) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# testbed adb measure M1 --size quick: X\\n1,2,3,4\\n# x\\x1b")
    assert lines[1].startswith("device,") and len(lines) == 4
    rows = read_measurements(out)
    assert rows[0].backend == "numpy-1.26\\r\\n0-phone" and len(rows[0].provenance) < 300
    printed = capsys.readouterr().out
    assert len(printed.splitlines()) == 1 and "\x1b" not in printed


class _Runner:
    def __init__(self, samples: list[Any]):
        self.samples = samples

    def describe(self) -> dict[str, str | int]:
        return {"device": "d", "backend": "b", "threads": 1, "cpu_model": "c"}

    def time_gemm(self, m: int, k: int, n: int, dtype: str, warmup: int,
                  repeats: int) -> list[float]:
        return self.samples


@pytest.mark.parametrize("samples", [[math.nan], [math.nan, 1e-3], [math.inf], [0.0], [-1e-3],
                                     [True], [1e-12], []])
def test_the_sweep_refuses_timings_a_measurement_file_cannot_hold(samples: list[Any]) -> None:
    """``min(got) < 0`` let NaN through (every comparison with NaN is false)."""
    from testbed.perf_model.measure import Shape, measure

    with pytest.raises(RuntimeError, match="returned bad timings"):
        measure([Shape("forward", 16, 64, 16)], _Runner(samples), repeats=1)


# -- 5. device states ------------------------------------------------------------------------------

def test_the_device_list_keeps_a_state_whole() -> None:
    listed = client.parse_device_list(f"A\tdevice\nB\t{NO_PERMISSIONS}\nC\tsideload\n")
    assert listed == {"A": "device", "B": NO_PERMISSIONS, "C": "sideload"}
    assert client.split_state(listed["B"]) == (
        "no permissions", "(user in plugdev group; are your udev rules wrong?); see "
                          "[http://developer.android.com/tools/device.html]")
    assert client.split_state("device") == ("device", "")
    assert client.split_state("no permissions; see [http://developer.android.com/tools/"
                              "device.html]") == (
        "no permissions", "see [http://developer.android.com/tools/device.html]")
    assert client.split_state("some new state") == ("some new state", "")


@pytest.mark.parametrize("state, fix", [
    ("unauthorized", "accept 'Allow USB debugging'"),
    ("offline", "unplug and plug in the cable again"),
    (NO_PERMISSIONS, "add your user to the plugdev group"),
    ("recovery", "boot the phone into Android"),
    ("sideload", "boot the phone into Android"),
    ("bootloader", "boot the phone into Android"),
    ("rescue", "boot the phone into Android"),
    ("authorizing", "wait a few seconds"),
    ("connecting", "wait a few seconds"),
    ("host", "name a phone instead"),
])
def test_the_doctor_gives_the_fix_of_each_adb_state(
        state: str, fix: str, fake_adb: VanishingServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake_adb.plug(FakePhone("S1", state=state))
    report = doctor(fake_adb, "S1").report()
    name = client.split_state(state)[0]
    assert f"[FAIL] phone: S1 is {name}" in report
    assert fix in report.split("fix:")[1], report
    row = devices_json(fake_adb, capsys)["S1"]
    assert row["state"] == name
    assert adb(fake_adb, "devices") == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert re.match(rf"S1 +{name} +", line) and adb_doctor.STATE_MEANINGS[name] in line
    if name == "no permissions":
        assert row["state_detail"].startswith("(user in plugdev group; are your udev rules")
        assert "udev rules wrong" in line and "udev rules for Android phones" in report


# -- 6. the doctor's probe port ------------------------------------------------------------------

def probe_phone(tmp_path: Path, payload: bytes, repeat: int = 1) -> FakePhone:
    """An unrooted phone whose probe port (7701) is dialled by something that sends
    ``payload`` ``repeat`` times instead of the probe's report."""
    def hook(phone: FakePhone, command: str) -> ShellResult | None:
        if command.startswith("python3 "):
            return ShellResult(stderr=b"no python\n", exit_code=127)
        if command.startswith("am startservice") and "probe" in command:
            port = phone.reverse_ports[7701]

            def dial() -> None:
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    try:
                        for _ in range(repeat):
                            conn.sendall(payload)
                    except OSError:
                        return
                    time.sleep(2)

            threading.Thread(target=dial, daemon=True).start()
            return ShellResult(stdout=b"Starting service: Intent { act=com.termux.RUN_COMMAND "
                                      b"cmp=com.termux/.app.RunCommandService }\n")
        return None

    return recorded_phone("T1", exec_hook=hook, termux=FakeTermux(work_dir=tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload, repeat, came", [
    (b"hello from another app\n", 1, "'hello from another app' (not JSON)"),
    (b"[1, 2, 3]\n", 1, "'[1, 2, 3]' (a JSON array, not an object)"),
    (b"\xff\xfe\n", 1, "(not UTF-8)"),
    (b"[" * 100_000 + b"\n", 1, "(not JSON)"),
    (b"", 1, "nothing within 0.5 s"),
    (b"A" * 65536, 40, "more than 1 MiB without an end of line"),
])
def test_the_doctor_fails_on_whatever_else_answers_the_probe_port(
        payload: bytes, repeat: int, came: str, fake_adb: VanishingServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any app on the phone may dial the probe port: its words were a traceback, and a flood
    without a newline was read for ever."""
    monkeypatch.setattr(adb_doctor, "REPORT_READ_S", 0.5, raising=False)
    fake_adb.plug(probe_phone(tmp_path, payload, repeat))
    report = doctor(fake_adb, "T1", listener_timeout_s=0.2, probe_timeout_s=10).report()
    line = next(x for x in report.splitlines() if x.startswith("[FAIL]"))
    assert line.startswith("[FAIL] probe report: 127.0.0.1:7701 on the phone got "), report
    assert came in line and line.endswith("not the probe's report (a JSON object on one line)")
    assert "--phone-port" in report


def test_the_doctor_names_an_app_that_holds_the_probe_port(
        fake_adb: VanishingServer, tmp_path: Path) -> None:
    """`adb reverse` of the probe port fails "Address already in use": that was "the adb
    connection failed mid-check ... check the cable"."""
    phone_port = free_port_base()  # the probe's port, D+1, and the control port, D+2, free
    probe_port = phone_port + 1
    with socket.socket() as other_app:
        other_app.bind(("127.0.0.1", probe_port))
        other_app.listen(1)
        phone = fake_adb.plug(recorded_phone("T1", termux=FakeTermux(work_dir=tmp_path),
                                             exec_hook=lambda p, c: ShellResult(exit_code=127)
                                             if c.startswith("python3 ") else None))
        phone.same_ports = True  # phone port D is this host's port D: the app holds it
        report = doctor(fake_adb, "T1", phone_port=phone_port,
                        listener_timeout_s=0.2).report()
    assert (f"[FAIL] probe port: adb reverse tcp:{probe_port} failed (cannot bind listener: "
            f"Address already in use): something on the phone already listens on "
            f"127.0.0.1:{probe_port} (another app)") in report
    assert "move the ports with --phone-port" in report


# -- 7. phone text on the terminal ---------------------------------------------------------------

def test_printable_escapes_control_characters_and_caps_the_length() -> None:
    assert client.printable("Evil\x1b[31mRED\n\u2028x\t") == "Evil\\x1b[31mRED\\n\\u2028x\\t"
    assert client.printable("A" * 2_000_000) == "A" * 77 + "..."
    assert client.printable("A" * 80) == "A" * 80
    assert client.printable("\n" * 80, most=10) == "\\n\\n\\n..."  # never half an escape
    once = client.printable("ok: ünïcode ☃ \\n")
    assert client.printable(once) == once == "ok: ünïcode ☃ \\n"


def with_prop(key: str, value: str) -> str:
    text = (DATA / "getprop_sd888.txt").read_text()
    lines = [line for line in text.splitlines() if not line.startswith(f"[{key}]")]
    return "\n".join(lines + [f"[{key}]: [{value}]"]) + "\n"


@pytest.mark.parametrize("model", ["Evil\x1b[31mRED\x1b[0m\nSERIAL2 device", "A" * 2_000_000])
def test_a_model_name_cannot_forge_rows_or_flood_the_terminal(
        model: str, fake_adb: VanishingServer, capsys: pytest.CaptureFixture[str]) -> None:
    phone = fake_adb.plug(recorded_phone("P1"))
    phone.commands["getprop"] = with_prop("ro.product.model", model)
    assert adb(fake_adb, "devices") == 0
    table = capsys.readouterr().out
    assert len(table.splitlines()) == 2 and "\x1b" not in table and len(table) < 1000
    report = doctor(fake_adb, "P1").report()
    android = next(x for x in report.splitlines() if "android:" in x)
    assert android.startswith("[ok] android: Android 12 (API 31), ")
    assert "\x1b" not in report and len(android) < 200
    assert not any(x.startswith("SERIAL2") for x in report.splitlines())


@pytest.mark.parametrize("getprop", ["", bytes(range(256)).decode("latin-1") * 4])
def test_an_empty_or_garbage_getprop_is_a_problem_not_a_blank_android(
        getprop: str, fake_adb: VanishingServer, capsys: pytest.CaptureFixture[str]) -> None:
    phone = fake_adb.plug(recorded_phone("P1"))
    phone.commands["getprop"] = getprop
    row = devices_json(fake_adb, capsys)["P1"]
    assert "ro.build.version.sdk" in row["problem"]
    report = doctor(fake_adb, "P1").report()
    android = next(x for x in report.splitlines() if "android:" in x)
    assert android.startswith("[FAIL] android: ") and "ro.build.version.sdk" in android
    assert "(API None)" not in report and "fix: `adb shell getprop ro.build.version.sdk`" in report

