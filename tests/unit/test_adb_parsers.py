"""ADB bridge pure parts: telemetry parsers on recorded samples, numbers in phone text, device
lists, profile choice, device names, the ``adb:`` config validator, and the agent zip (really
run with this Python)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.adb_bridge import parsers, telemetry, termux_control
from testbed.adb_bridge.agent_package import agent_files, build_agent_zip
from testbed.adb_bridge.client import diff_states, parse_device_list
from testbed.adb_bridge.config import device_name, validate_adb_section
from testbed.adb_bridge.phone_info import PhoneInfo, choose_profile, support_problem
from testbed.names import is_name

DATA = Path(__file__).resolve().parents[1] / "data" / "adb"


def sample(name: str) -> str:
    return (DATA / name).read_text()


# -- getprop and profiles --------------------------------------------------------------------------

def test_getprop_multiline_and_empty_values() -> None:
    props = parsers.parse_getprop(sample("getprop_pixel6.txt"))
    assert props["ro.product.model"] == "Pixel 6"
    assert props["persist.sys.test.motd"] == "first line\nsecond line"
    assert props["sys.empty.value"] == ""
    assert props["ro.build.version.sdk"] == "33"


@pytest.mark.parametrize("name, soc, profile, sdk", [
    ("getprop_sd888.txt", "sm8350", "snapdragon888", 31),
    ("getprop_pixel6.txt", "tensor", None, 33),
    ("getprop_old.txt", "mt6765", None, 23),
])
def test_phone_info_and_profile(name: str, soc: str, profile: str | None, sdk: int) -> None:
    props = parsers.parse_getprop(sample(name))
    info = PhoneInfo.from_props("S", props)
    assert (info.soc, info.sdk) == (soc, sdk)
    choice = choose_profile(info, props)
    assert choice.profile == profile
    assert ("measured live" in choice.reason) == (profile is None)


def test_profile_requests_and_old_android() -> None:
    props = parsers.parse_getprop(sample("getprop_old.txt"))
    info = PhoneInfo.from_props("S", props)
    assert choose_profile(info, props, "m2pro").profile == "m2pro"
    assert choose_profile(info, props, "measured").profile is None
    assert "too old" in (support_problem(info) or "")
    sd = PhoneInfo.from_props("S", parsers.parse_getprop(sample("getprop_sd888.txt")))
    assert support_problem(sd) is None



# -- numbers in phone text ---------------------------------------------------------------------
# (through module attributes, so that on code without parse_int only these tests fail)

@pytest.mark.parametrize("text, number", [
    ("31", 31), (" 31\n", 31), ("0", 0), ("9" * 19, int("9" * 19)),
    ("\u00b2", None), ("\u0661\u0662", None), ("9" * 5000, None), ("9" * 20, None),
    ("-1", None), ("+1", None), ("1e3", None), ("0x10", None), ("", None), (None, None),
])
def test_parse_int_takes_ascii_digits_only_and_not_too_many(text: str | None,
                                                           number: int | None) -> None:
    """'²' passes str.isdigit() but not int(); int() refuses more than 4300 digits."""
    assert parsers.parse_int(text) == number


@pytest.mark.parametrize("sdk", ["\u00b2", "\u0661\u0662", "9" * 5000, "abc", "-1", ""])
def test_an_unusable_sdk_is_no_usable_android_version(sdk: str) -> None:
    props = {**parsers.parse_getprop(sample("getprop_sd888.txt")), "ro.build.version.sdk": sdk}
    info = PhoneInfo.from_props("S", props)
    assert info.sdk is None
    assert "no usable Android version" in (support_problem(info) or "")


def test_numbers_in_telemetry_and_termux_text_never_raise() -> None:
    thermal = parsers.parse_dumpsys_thermalservice("Thermal Status: " + "9" * 5000 + "\n")
    assert thermal.available and thermal.status is None
    cpufreq = ("/sys/devices/system/cpu/cpu" + "9" * 5000 + "/cpufreq/scaling_cur_freq:1000\n"
               "/sys/devices/system/cpu/cpu\u0663/cpufreq/scaling_cur_freq:1000\n"
               "/sys/devices/system/cpu/cpu2/cpufreq/scaling_cur_freq:1000\n")
    assert parsers.parse_cpufreq(cpufreq) == {2: 1e6}
    assert telemetry.build_sample("", "", "Thermal Status: " + "9" * 5000, "", cpufreq)[
        "cpu_freq_hz"] == {"2": 1e6}
    assert termux_control.parse_package_uid("package:com.termux uid:" + "1" * 5000) is None
    assert termux_control.parse_package_uid("userId=\u0661\u0662") is None
    assert termux_control.parse_package_uid("package:com.termux uid:10234\n") == 10234
    line = ("   0: 0100007F:1E0A 0100007F:9C40 01 00000000:00000000 00:00000000 00000000 "
            "{uid}     0 {inode} 1 0000000000000000 20 4 30 10 -1")
    table = "\n".join(line.format(uid=u, inode=i) for u, i in
                      (("\u00b2", 1), ("1" * 5000, 2), ("10234", "9" * 5000), ("10234", 7)))
    assert [(s.uid, s.inode) for s in termux_control.parse_proc_net_tcp(table)] == [(10234, 7)]


# -- device names ----------------------------------------------------------------------------------

def test_device_names_are_unique_valid_and_readable() -> None:
    """Serials that sanitize alike get names of their own; upper-case serials stay plain."""
    assert device_name("R58M12ABCDE") == "adb-r58m12abcde"
    assert device_name("E2EPHONE1") == "adb-e2ephone1"
    assert device_name("PHONE.1") == "adb-phone-1-dd7b4e" == device_name("PHONE.1")
    serials = ["PHONE.1", "phone_1", "phone-1", "PHONE-1", "Phone-1", "PHONE1", "phone1",
               "PHONE-1-DD7B4E", "emulator-5554", "EMULATOR-5554", "192.168.1.23:5555",
               "192-168-1-23-5555", "A" * 20, "A" * 21, "A" * 22, "", "-", "\u00b2",
               "adb-XXXX1234-abcdef._adb-tls-connect._tcp"]
    names = [device_name(s) for s in serials]
    assert len(set(names)) == len(serials), names
    assert all(is_name(n) and n.startswith("adb-") for n in names), names


# -- battery ---------------------------------------------------------------------------------------

def test_dumpsys_battery_aosp() -> None:
    b = parsers.parse_dumpsys_battery(sample("battery_aosp.txt"))
    assert b.level_fraction == 0.85 and b.temperature_c == pytest.approx(31.2)
    assert b.voltage_v == pytest.approx(4.312) and b.status == "charging" and b.plugged == "usb"
    assert b.current_a is None  # AOSP does not print a current


def test_dumpsys_battery_vendor_current_in_ma_discharging() -> None:
    b = parsers.parse_dumpsys_battery(sample("battery_samsung.txt"))
    assert b.status == "discharging" and b.plugged == "none"
    assert b.current_a == pytest.approx(-0.812)  # 812 mA out of the battery
    assert b.temperature_c == pytest.approx(34.7) and b.level_fraction == 0.57


def test_dumpsys_battery_missing_fields() -> None:
    b = parsers.parse_dumpsys_battery(sample("battery_missing.txt"))
    assert b.level_fraction == 1.0 and b.status == "full"
    assert (b.temperature_c, b.voltage_v, b.current_a, b.plugged) == (None, None, None, None)


@pytest.mark.parametrize("name, current_a, voltage_v, status", [
    ("uevent_ua_negative.txt", 1.25, 4.312, "charging"),  # µA, negative while charging
    ("uevent_ma_positive.txt", -0.812, 3.891, "discharging"),  # mA, positive while discharging
    ("uevent_missing.txt", None, None, "not-charging"),
])
def test_power_supply_uevent(name: str, current_a: float | None, voltage_v: float | None,
                             status: str) -> None:
    b = parsers.parse_power_supply_uevent(sample(name))
    assert b.status == status
    assert b.current_a == (None if current_a is None else pytest.approx(current_a))
    assert b.voltage_v == (None if voltage_v is None else pytest.approx(voltage_v))


def test_current_sign_without_status_keeps_kernel_sign() -> None:
    assert parsers.normalize_current_a(-1_500_000, None) == pytest.approx(-1.5)
    assert parsers.normalize_current_a(900, None) == pytest.approx(0.9)


def test_battery_merge_fills_missing_current() -> None:
    merged = parsers.parse_dumpsys_battery(sample("battery_aosp.txt")).merged(
        parsers.parse_power_supply_uevent(sample("uevent_ua_negative.txt")))
    assert merged.current_a == pytest.approx(1.25) and merged.plugged == "usb"


# -- thermal ---------------------------------------------------------------------------------------

def test_thermalservice_aosp_prefers_live_hal_values() -> None:
    t = parsers.parse_dumpsys_thermalservice(sample("thermal_aosp.txt"))
    assert t.available and t.status == 2 and t.status_name == "moderate"
    by_name = {s.name: s for s in t.sensors}
    assert by_name["cpu0-silver-usr"].temperature_c == 47.5  # HAL, not the cached 44.1
    assert by_name["battery"].kind == "battery" and by_name["skin-msm-therm"].kind == "skin"
    assert t.max_c() == 51.25 and t.max_c("gpu") == 39.8


def test_thermalservice_unknown_types_and_nan() -> None:
    t = parsers.parse_dumpsys_thermalservice(sample("thermal_unknown_types.txt"))
    by_name = {s.name: s for s in t.sensors}
    assert by_name["vendor-special"].kind == "type-42"
    assert by_name["xo-therm"].kind == "unknown"
    assert by_name["skin"].temperature_c is None  # NaN is "no reading", not a number
    assert t.status == 0 and t.max_c() == 41.0


def test_thermalservice_missing() -> None:
    t = parsers.parse_dumpsys_thermalservice(sample("thermal_missing.txt"))
    assert not t.available and t.sensors == () and t.status is None


def test_thermal_zones_units_errors_and_duplicates() -> None:
    zones = parsers.parse_thermal_zones(sample("thermal_zones.txt"))
    assert zones == {"cpu-0-0-usr": 47.5, "cpu-1-0-usr": 49.1, "battery": 33.6,
                     "cpu-0-0-usr#2": 46.0, "mtktscpu": 44.0}
    # xo-therm could not be read; pm8350b-tz reported a -273 °C sentinel: both left out.


def test_cpufreq_khz_to_hz_and_offline_core() -> None:
    freqs = parsers.parse_cpufreq(sample("cpufreq.txt"))
    assert sorted(freqs) == [0, 1, 2, 3, 4, 6, 7]
    assert freqs[7] == pytest.approx(2.8416e9) and freqs[0] == pytest.approx(1.8048e9)
    # a reading whose Hz overflow a float is no reading (telemetry must stay finite JSON)
    huge = "/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq:1e306\n"
    assert parsers.parse_cpufreq(huge) == {}


def test_telemetry_sample_combines_everything() -> None:
    s = telemetry.build_sample(sample("battery_aosp.txt"), sample("uevent_ua_negative.txt"),
                               sample("thermal_aosp.txt"), sample("thermal_zones.txt"),
                               sample("cpufreq.txt"))
    assert s["battery_current_a"] == pytest.approx(1.25) and s["thermal_max_c"] == 51.25
    assert s["cpu_freq_hz"]["4"] == pytest.approx(2.4192e9)
    old = telemetry.build_sample(sample("battery_missing.txt"), "", sample("thermal_missing.txt"),
                                 sample("thermal_zones.txt"), "")
    assert old["thermal_status"] is None and old["thermal_max_c"] == 49.1  # from the zones


# -- device lists ----------------------------------------------------------------------------------

def test_device_list_parse_and_diff() -> None:
    old = parse_device_list("A\tdevice\nB\tunauthorized\n")
    new = parse_device_list("B\tdevice\nC\toffline\n")
    assert diff_states(old, new) == [("A", "device", None), ("B", "unauthorized", "device"),
                                     ("C", None, "offline")]
    assert parse_device_list("") == {}


# -- config ----------------------------------------------------------------------------------------

def test_adb_config_valid() -> None:
    spec, problems = validate_adb_section({
        "enabled": True, "server": "127.0.0.1:5038", "serials": ["A1", "B2"],
        "profile": "snapdragon888", "phone_port": 7711, "telemetry_interval": "500ms",
        "link": {"down": "100Mbit", "up": "20Mbit", "delay": "10ms"}})
    assert problems == []
    assert spec.enabled and (spec.server_host, spec.server_port) == ("127.0.0.1", 5038)
    assert spec.serials == ("A1", "B2") and spec.telemetry_interval_s == 0.5
    assert spec.shaping.down_bps == 100e6 and spec.shaping.up_bps == 20e6
    assert spec.shaping.delay_s == pytest.approx(0.01)
    with pytest.raises(AttributeError):
        spec.enabled = False  # type: ignore[misc]


def test_adb_config_reports_every_problem_with_its_path() -> None:
    _, problems = validate_adb_section({
        "enabled": "yes", "server": "nohost", "serials": ["A", "A", ""], "profile": "nope",
        "phone_port": 70000, "telemetry_interval": 2, "colour": "red",
        "link": {"down": "100Mbits", "loss": "1%", "jitter": "1ms"}})
    paths = [p for p, _ in problems]
    assert paths == ["adb.colour", "adb.enabled", "adb.server", "adb.serials[1]",
                     "adb.serials[2]", "adb.profile", "adb.phone_port",
                     "adb.telemetry_interval", "adb.link.loss", "adb.link.jitter",
                     "adb.link.down"]
    messages = dict(problems)
    assert "no unit" in messages["adb.telemetry_interval"]
    assert "TCP stream" in messages["adb.link.loss"]
    # the control port is 2 above the phone port: it must be a port too
    assert validate_adb_section({"phone_port": 65533})[1] == []
    (problem,) = validate_adb_section({"phone_port": 65534})[1]
    assert problem[0] == "adb.phone_port" and "1..65533" in problem[1]


def test_adb_config_absent_means_disabled() -> None:
    spec, problems = validate_adb_section(None)
    assert not spec.enabled and problems == [] and spec.serials is None
    assert validate_adb_section([1])[1] == [("adb", "expected a mapping, got list")]


# -- the agent zip ---------------------------------------------------------------------------------

def test_agent_zip_runs_the_agent_module(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "testbed" / "agent").mkdir(parents=True)
    (root / "testbed" / "__init__.py").write_text("")
    (root / "testbed" / "agent" / "__init__.py").write_text("")
    (root / "testbed" / "agent" / "__main__.py").write_text(
        "import sys\nprint('agent args', sys.argv[1:])\n")
    data = build_agent_zip(root)
    assert data == build_agent_zip(root)  # deterministic: same sources, same bytes
    path = tmp_path / "agent.zip"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, str(path), "--ps", "127.0.0.1:7700"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "agent args ['--ps', '127.0.0.1:7700']"


def test_agent_zip_of_this_checkout_runs_without_torch(tmp_path: Path) -> None:
    """The real agent, zipped, starts from the zip alone and loads no torch or yaml."""
    names = [p.as_posix() for p in agent_files()]
    assert "testbed/agent/__main__.py" in names
    assert not any(n.startswith("testbed/ps_backend/engine") for n in names)
    path = tmp_path / "agent.zip"
    path.write_bytes(build_agent_zip())
    probe = ("import runpy, sys; sys.argv = ['agent', '--help']\n"
             "try:\n    runpy.run_module('testbed.agent', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "import testbed.agent\n"
             "assert testbed.agent.__file__.startswith(sys.path[0]), testbed.agent.__file__\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'yaml')))\n")
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(path)!r})"
                          f"\n{probe}"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--ps" in out.stdout and out.stdout.strip().endswith("[]")


def test_agent_zip_refuses_torch(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "testbed" / "agent").mkdir(parents=True)
    (root / "testbed" / "__init__.py").write_text("")
    (root / "testbed" / "agent" / "__init__.py").write_text("import torch\n")
    with pytest.raises(ValueError, match="imports torch"):
        build_agent_zip(root)


@pytest.mark.parametrize("value, expected", [
    ("0s", "a duration must be above 0, got '0s'"),
    ("-3s", "expected a duration such as '10ms'"),
    ("25", "(no unit)"),
    ("soon", "expected a duration such as '10ms', got 'soon'"),
])
def test_doctor_probe_timeout_must_be_a_duration_above_zero(
        value: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.cli import main

    assert main(["adb", "doctor", f"--probe-timeout={value}"]) == 2
    err = capsys.readouterr().err
    assert "--probe-timeout" in err and expected in err
