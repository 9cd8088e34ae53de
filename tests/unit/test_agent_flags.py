"""The agent's own flags (``python -m testbed.agent``, ``testbed join``): a token file read only
so far, a window within the protocol's limit, and a PS not reachable yet said in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from testbed.agent.__main__ import build_parser, main
from testbed.wire import MAX_IN_FLIGHT
from tests.conftest import cli_argv, closed_port

PIN = "sha256:" + "ab" * 32  # well formed; no PS has it


def test_a_token_file_with_no_end_of_line_is_refused_unread(capsys) -> None:
    code = main(["--ps", "127.0.0.1:1", "--name", "a-0", "--token-file", "/dev/zero"])
    assert code == 2
    assert "--token-file /dev/zero: its first line is longer than 4,096 bytes" in \
        capsys.readouterr().err


def test_a_token_can_come_through_a_pipe(tmp_path: Path) -> None:
    from testbed.agent.__main__ import build_parser, read_token

    fifo = tmp_path / "token"
    os.mkfifo(fifo)  # as `--token-file <(pass show run)` gives it

    def write() -> None:
        with open(fifo, "w") as f:
            f.write("  secret-token  \nsecond line\n")

    writer = threading.Thread(target=write)
    writer.start()
    args = build_parser().parse_args(["--ps", "x:1", "--name", "a", "--token-file", str(fifo)])
    assert read_token(args) == "secret-token"
    writer.join(10)


@pytest.mark.parametrize("window", [0, -5, MAX_IN_FLIGHT + 1])
def test_a_window_outside_the_protocols_limit_is_refused(capsys, window: int) -> None:
    assert main(["--ps", "127.0.0.1:1", "--name", "a-0", "--max-in-flight", str(window)]) == 2
    assert f"--max-in-flight: expected 1 to {MAX_IN_FLIGHT}, got {window}" in \
        capsys.readouterr().err


def test_join_says_in_one_line_that_the_ps_is_not_there_and_tries_again(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    proc = subprocess.Popen(cli_argv("join", f"127.0.0.1:{closed_port()}", "--fingerprint", PIN,
                                     "--token-file", str(token), "--name", "lan-0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    tried_twice = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if sum("no TLS handshake with 127.0.0.1" in seen for seen in lines) >= 2:
                tried_twice.set()
        tried_twice.set()  # it ended on its own (wrong: the assertions below say how)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # two tries, however long the CLI takes to start (seconds on a loaded machine)
        tried_twice.wait(60)
    finally:
        if proc.poll() is None:  # still trying, as it should: stop it as a user would
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(20)
        if proc.stdout is not None and not reader.is_alive():
            proc.stdout.close()
    out = "".join(lines)
    tries = [line for line in out.splitlines() if "no TLS handshake with 127.0.0.1" in line]
    assert len(tries) >= 2 and all("joining again in" in line for line in tries), out
    assert "Traceback" not in out, out
    assert proc.returncode == 130, out  # interrupted, as every testbed command


@pytest.mark.parametrize("flag, value", [
    ("--cache-mib", "inf"), ("--cache-mib", "1e30"), ("--cache-mib", "-5"), ("--cache-mib", "0"),
    ("--gflops", "nan"), ("--gflops", "-1"), ("--loss", "2"), ("--loss", "-1"),
    ("--delay-s", "-1"), ("--delay-s", "nan"), ("--down-bps", "0"), ("--up-bps", "nan"),
    ("--byzantine-noise", "nan"), ("--byzantine-rate", "1.5"), ("--straggler-factor", "0.5"),
    ("--seed", "-1")])
def test_the_agents_numbers_are_checked_before_it_starts(flag: str, value: str, capsys) -> None:
    """`--cache-mib inf` was a traceback, 1e30 a join retried for ever with a traceback each
    time, and -5, nan or a negative delay started an agent."""
    with pytest.raises(SystemExit) as exited:
        main(["--ps", "127.0.0.1:1", "--name", "a-0", "--token", "t", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: expected" in capsys.readouterr().err


def test_a_loss_of_one_is_refused_as_a_topology_refuses_it(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--ps", "127.0.0.1:1", "--name", "a-0", "--token", "t", "--loss", "1"])
    assert exited.value.code == 2
    assert "argument --loss: expected a number from 0 to 1 (not included)" in \
        capsys.readouterr().err
    # just below 1 is a probability the link can have
    assert build_parser().parse_args(["--ps", "127.0.0.1:1", "--name", "a-0",
                                      "--loss", "0.999"]).loss == 0.999
