"""Extreme inputs to `testbed join`, `testbed compare --simulate` and `testbed adb`: each is
refused where it is first read, with exit 2 and a message naming the option, file or field,
before anything starts (no agent retrying for ever, no comparison directory half written)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from testbed.cli import main
from tests.conftest import cli_argv, closed_port
from tests.unit.test_baselines_compare import write_topology

PIN = "sha256:" + "ab" * 32  # well formed; no PS has it


def run_cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
            ) -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter (a token file is refused by the agent `testbed join`
    starts, and a join that is not refused runs until the timeout, which fails the test;
    adbutils must not be imported already)."""
    proc = subprocess.Popen(cli_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{' '.join(args)}: still running after {timeout_s:g} s (not refused)")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch,
            cli_here: Callable[..., subprocess.CompletedProcess[str]]
            ) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``refused(*args)``: the command through the command line's entry point in this process,
    for a `testbed join` that its parser must refuse: were it not refused, the agent it starts
    fails the test at once (in place of an agent retrying a PS for ever)."""
    import testbed.agent.__main__ as agent_main

    def not_refused(argv: list[str], stopped_exit: int = 0) -> int:
        pytest.fail(f"not refused: the agent was started with {argv}")

    monkeypatch.setattr(agent_main, "main", not_refused)
    return cli_here


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tok"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    return path


# -- A. testbed join ---------------------------------------------------------------------------

@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.0.0.1:notaport", "", ":", "127.0.0.1:99999999999999999999999",
    "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:-5", "http://127.0.0.1:9", "::1:50051",
    "[not-v6]:5", "999.0.0.1:5"])
def test_join_refuses_a_malformed_ps_address(address: str, token_file: Path,
                                             refused: Callable[..., Any]) -> None:
    done = refused("join", address, "--fingerprint", PIN, "--token-file", str(token_file))
    assert done.returncode == 2, done.stderr
    assert "testbed join: error: argument PS_ADDRESS: expected HOST:PORT" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("content", [b"", b"   \n", b"\n\ntoken\n", b"\x89PNG\r\n\x1a\n\x00\x01",
                                     b"tok\x00en\n", b"\xff\xfe\xfd\n"])
def test_join_refuses_an_empty_blank_or_binary_token_file(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "tok"
    path.write_bytes(content)
    done = run_cli("join", f"127.0.0.1:{closed_port()}", "--fingerprint", PIN,
                   "--token-file", str(path))
    assert done.returncode == 2, done.stderr
    assert f"error: --token-file {path}: its first line" in done.stderr


@pytest.mark.parametrize("name", ["-x", "", "a\nb", "Laptop", "a" * 25, "a b", "a\n"])
def test_join_refuses_a_name_a_topology_could_not_have(name: str, token_file: Path,
                                                      refused: Callable[..., Any]) -> None:
    done = refused("join", f"127.0.0.1:{closed_port()}", "--fingerprint", PIN,
                   "--token-file", str(token_file), f"--name={name}")
    assert done.returncode == 2, done.stderr
    assert "testbed join: error: argument --name: expected lower-case letters" in done.stderr
    assert "python -m testbed.agent" not in done.stderr


def test_join_makes_its_default_name_from_any_host_name() -> None:
    from testbed.agent.join import default_name, device_name_arg

    for host in ("My-Laptop.local", "DESKTOP_1234", "x" * 80, "---", "ünïcode"):
        assert device_name_arg(default_name(host)) == default_name(host)
    assert default_name("My-Laptop.local") == "my-laptop"


# -- B. testbed compare --simulate -------------------------------------------------------------

def compare_refused(tmp_path: Path, *extra: str) -> None:
    """Run compare with ``extra``; assert exit 2 and that no directory was made."""
    topology = write_topology(tmp_path)
    out = tmp_path / "out"
    code = main(["compare", str(topology), "--simulate", "--no-report", "--out", str(out),
                 *extra])
    assert code == 2
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


GPU_GOOD = {"name": "g", "peak_fp32_flops": "27.8e12", "memory": "24GiB",
            "memory_bytes_s": "768e9", "board_power_w": 230, "sustained_fraction": 0.5}


@pytest.mark.parametrize("field,value", [
    ("peak_fp32_flops", 0), ("sustained_fraction", 0), ("memory_bytes_s", 0),
    ("peak_fp32_flops", -1e12), ("memory_bytes_s", ".nan"), ("board_power_w", -230),
    ("sustained_fraction", 1.5), ("board_power_w", ".inf"), ("memory", "0GiB"),
    ("peak_fp32_flops", "lots"), ("board_power_w", True)])
def test_compare_checks_every_gpu_figure_before_any_simulation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object) -> None:
    lines = [f"{k}: {value if k == field else v}" for k, v in GPU_GOOD.items()]
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text("\n".join(lines) + "\n")
    compare_refused(tmp_path, "--gpu", str(gpu))
    err = capsys.readouterr().err
    assert f"--gpu {gpu}" in err and f"  - {field}: expected" in err, err


@pytest.mark.parametrize("text,says", [
    ("[" * 5000 + "]" * 5000, "nested more than"),
    ("name: g\nname: h\n", "written twice"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("name: g\nflops: 1\n", "flops: unknown key")])
def test_compare_refuses_a_gpu_file_that_is_not_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str) -> None:
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text(text)
    compare_refused(tmp_path, "--gpu", str(gpu))
    err = capsys.readouterr().err
    assert f"--gpu {gpu}" in err and says in err, err


def test_compare_refuses_a_strategy_named_twice(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    compare_refused(tmp_path, "--strategies", "tile-tp,pipeline,tile-tp")
    assert "--strategies: tile-tp named more than once" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "up", "compare"])
@pytest.mark.parametrize("option", ["--churn", "--out"])
def test_an_empty_path_is_refused_not_taken_for_none(command: str, option: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--churn ''` ran without the trace and `--out ''` wrote into the working directory."""
    assert main([command, str(write_topology(tmp_path)), option, ""]) == 2
    assert f"argument {option}: expected a path, got an empty string" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["t.yaml"]  # nothing written


def test_compare_refuses_a_churn_trace_under_which_no_device_is_present(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "gone.csv"
    trace.write_text("time_s,device,event,arg\n0,phones:4,leave,\n")
    compare_refused(tmp_path, "--churn", str(trace))
    err = capsys.readouterr().err
    assert f"{trace}: no device is ever present" in err, err


@pytest.mark.parametrize("size,says", [("0B", "expected a size from 1GiB"),
                                        ("512MiB", "expected a size from 1GiB"),
                                        ("abc", "expected a size such as"),
                                        ("64", "no unit")])
def test_compare_refuses_a_ps_memory_that_is_no_size_of_a_ps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str, says: str) -> None:
    compare_refused(tmp_path, "--ps-memory", size)
    err = capsys.readouterr().err
    assert "argument --ps-memory:" in err and says in err, err


# -- C. testbed adb ----------------------------------------------------------------------------

@pytest.mark.parametrize("command, value", [(["doctor"], "abc"), (["measure", "SERIAL"], "abc"),
                                            (["devices"], "abc"),
                                            (["doctor", "--adb", "127.0.0.1:5037"], "abc"),
                                            (["devices"], ""),  # set but empty: int('')
                                            (["devices", "--adb", "127.0.0.1:5037"], " ")])
def test_adb_refuses_a_bad_server_port_variable_before_adbutils_reads_it(
        command: list[str], value: str) -> None:
    env = dict(os.environ, ANDROID_ADB_SERVER_PORT=value)
    done = run_cli("adb", *command, env=env)
    assert done.returncode == 2, done.stderr
    assert "error: ANDROID_ADB_SERVER_PORT: expected a TCP port (1-65535), got " \
        f"{value.strip()!r}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("address", ["[x]:5037", "127.0.0.1:0", "[::1]", "http://h:5037"])
def test_adb_refuses_a_malformed_adb_address(address: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["adb", "devices", "--adb", address]) == 2
    assert "error: --adb: expected HOST:PORT" in capsys.readouterr().err


@pytest.fixture
def ipv6_adb_server() -> Iterator[int]:
    """An adb server on [::1] that knows no phones (answers host:devices with an empty list)."""
    try:
        listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        listener.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    listener.listen()
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                length = int(conn.recv(4), 16)
                conn.recv(length)
                conn.sendall(b"OKAY0000")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_adb_reaches_a_server_at_a_bracketed_ipv6_address(
        ipv6_adb_server: int, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"[::1]:{ipv6_adb_server}"
    assert main(["adb", "devices", "--adb", address]) == 0, capsys.readouterr().err
    assert f"no phones on the adb server at {address}" in capsys.readouterr().out


@pytest.mark.parametrize("timeout", ["1e300s", "11min", "2h"])
def test_adb_doctor_bounds_the_probe_timeout(timeout: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["adb", "doctor", "--adb", f"127.0.0.1:{closed_port()}",
                 "--probe-timeout", timeout]) == 2
    err = capsys.readouterr().err
    assert "argument --probe-timeout: expected at most 600s" in err, err


@pytest.mark.parametrize("argv, usage, unknown", [
    (["net", "check", "topologies/home-wifi.yaml", "--bogus"], "testbed net check", "--bogus"),
    (["simulate", "topologies/home-wifi.yaml", "--stepz", "2"], "testbed simulate", "--stepz 2"),
    (["trace", "show", "x.csv", "--bogus"], "testbed trace show", "--bogus"),
])
def test_an_unknown_option_is_said_with_its_commands_usage(
        argv: list[str], usage: str, unknown: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse leaves unknown arguments to the top parser: `usage: testbed [-h] [-v]
    COMMAND ...`, which does not say what the command takes."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} "), err
    assert f"{usage}: error: unrecognized arguments: {unknown}" in err, err
