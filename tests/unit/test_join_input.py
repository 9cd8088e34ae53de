"""`testbed join`'s input from the environment ($TESTBED_TLS_FINGERPRINT, $TESTBED_TOKEN_FILE,
$TESTBED_TOKEN): a bad value is refused before the agent starts (exit 2), in a line that names
the variable it came from, not an option the user never gave; a good one reaches the agent as
a token file's line would."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from testbed.cli import main

PIN = "sha256:" + "ab" * 32  # well formed; no PS has it
ADDRESS = "127.0.0.1:50999"  # never connected to: the agent is a fake below


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces the agent `testbed join` starts: records its argv and the token it would read
    from the environment, and returns 0 at once (no connection, no retry loop)."""
    import testbed.agent.__main__ as agent_main

    calls: list[dict[str, Any]] = []

    def fake(argv: list[str], stopped_exit: int = 0) -> int:
        calls.append({"argv": argv, "token": os.environ.get("TESTBED_TOKEN")})
        return 0

    monkeypatch.setattr(agent_main, "main", fake)
    for name in ("TESTBED_TLS_FINGERPRINT", "TESTBED_TOKEN_FILE", "TESTBED_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_a_bad_fingerprint_from_the_environment_is_named_as_such(
        monkeypatch: pytest.MonkeyPatch, agent: list[dict[str, Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "tok"
    token.write_text("t0ken\n")
    monkeypatch.setenv("TESTBED_TLS_FINGERPRINT", "sha256:bad")
    assert main(["join", ADDRESS, "--token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert "error: $TESTBED_TLS_FINGERPRINT: not a SHA-256 fingerprint: 'sha256:bad'" in err
    assert "--fingerprint" not in err  # the option was never given
    assert not agent


def test_a_good_fingerprint_from_the_environment_reaches_the_agent(
        monkeypatch: pytest.MonkeyPatch, agent: list[dict[str, Any]], tmp_path: Path) -> None:
    token = tmp_path / "tok"
    token.write_text("t0ken\n")
    monkeypatch.setenv("TESTBED_TLS_FINGERPRINT", PIN.upper().replace("SHA256:", ""))
    monkeypatch.delenv("TESTBED_TOKEN", raising=False)  # join sets it: restored after
    assert main(["join", ADDRESS, "--token-file", str(token)]) == 0
    assert f"--tls-fingerprint={PIN}" in agent[0]["argv"]
    # read once by join (the file may be a pipe), handed to the agent as $TESTBED_TOKEN
    assert not any(a.startswith("--token-file") for a in agent[0]["argv"])
    assert os.environ["TESTBED_TOKEN"] == "t0ken"


@pytest.mark.parametrize("where", ["option", "environment"])
@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_a_token_file_that_is_not_one_is_named_with_where_it_came_from(
        monkeypatch: pytest.MonkeyPatch, agent: list[dict[str, Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], where: str, kind: str) -> None:
    path = tmp_path / "gone" if kind == "missing" else tmp_path
    if kind == "binary":  # its content was blamed on --token-file, given or not
        path = tmp_path / "token.bin"
        path.write_bytes(b"\x00\x01\xff")
    argv = ["join", ADDRESS, "--fingerprint", PIN]
    if where == "option":
        argv += ["--token-file", str(path)]
    else:
        monkeypatch.setenv("TESTBED_TOKEN_FILE", str(path))
    assert main(argv) == 2
    source = "--token-file" if where == "option" else "$TESTBED_TOKEN_FILE"
    what = {"missing": "no such file; expected the join-token file",
            "directory": "a directory; expected the join-token file",
            "binary": "its first line is not text (a binary file?)"}[kind]
    assert f"error: {source} {path}: {what}" in capsys.readouterr().err
    assert not agent


def test_a_token_file_saved_by_a_windows_editor_is_read(
        agent: list[dict[str, Any]], tmp_path: Path) -> None:
    token = tmp_path / "tok"
    token.write_bytes("\ufefft0ken\r\n".encode())  # a BOM, and CRLF
    assert main(["join", ADDRESS, "--fingerprint", PIN, "--token-file", str(token)]) == 0
    assert agent[0]["token"] == "t0ken"


def test_a_fifo_nobody_writes_to_is_said_to_be_waited_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`mkfifo tok` and no writer: the open blocks; it was silent for as long as it did."""
    import threading

    from testbed.agent.__main__ import TOKEN_WAIT_NOTE_S, read_token_file
    fifo = tmp_path / "tok"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(read_token_file(str(fifo))),
                              daemon=True)
    reader.start()
    reader.join(TOKEN_WAIT_NOTE_S + 1.5)
    assert reader.is_alive() and not got  # still waiting, as it should
    assert f"waiting for the token's line from {fifo}" in capsys.readouterr().err
    with open(fifo, "w") as writer:
        writer.write("t0ken\n")
    reader.join(5)
    assert got == ["t0ken"]


def test_a_token_from_the_environment_with_a_line_break_is_refused(
        monkeypatch: pytest.MonkeyPatch, agent: list[dict[str, Any]],
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TESTBED_TOKEN", "t0ken\nsecond line")
    assert main(["join", ADDRESS, "--fingerprint", PIN]) == 2
    assert "error: $TESTBED_TOKEN holds control characters" in capsys.readouterr().err
    assert not agent


def test_a_token_from_the_environment_is_stripped_as_a_token_files_line_is(
        monkeypatch: pytest.MonkeyPatch, agent: list[dict[str, Any]]) -> None:
    # `TESTBED_TOKEN="$(cat join-token) "` or a pasted trailing newline: the PS would refuse
    # the token with its blank as a wrong one (exit 3), for a right token
    monkeypatch.setenv("TESTBED_TOKEN", "  t0ken \n")
    assert main(["join", ADDRESS, "--fingerprint", PIN]) == 0
    assert agent[0]["token"] == "t0ken"
    assert not any(a.startswith("--token") for a in agent[0]["argv"])  # never on the line


def test_no_token_anywhere_is_refused(agent: list[dict[str, Any]],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["join", ADDRESS, "--fingerprint", PIN]) == 2
    assert "error: no token: give --token-file FILE" in capsys.readouterr().err
    assert not agent


def test_join_asks_its_agent_for_progress(agent: list[dict[str, Any]], tmp_path: Path) -> None:
    """A joined device said nothing from its join to the run's end (tests/unit/
    test_agent_progress.py has the line itself)."""
    from testbed.agent.join import PROGRESS_S

    token = tmp_path / "tok"
    token.write_text("t0ken\n")
    assert main(["join", ADDRESS, "--fingerprint", PIN, "--token-file", str(token)]) == 0
    assert f"--progress-s={PROGRESS_S:g}" in agent[0]["argv"]
