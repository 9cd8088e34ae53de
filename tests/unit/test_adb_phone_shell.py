"""PhoneShell: every shell command on a phone has one deadline, a size limit and the same
answer on shell protocol v2 and v1, against the fake adb server (the real ADB host protocol).

adbutils' ``shell2`` times out per read (a command that keeps printing never times out) and,
on a phone whose adbd lacks ``shell_v2`` (Android 6 and older), returns an empty ``stdout``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from testbed.adb_bridge.client import AdbServer, PhoneCommandError, PhoneShell, ShellOutput
from tests.fakes.fake_adb import FakeAdbServer, FakePhone, ShellResult

ANSWER = ShellResult(stdout=b"out\r\n", stderr=b"err\n", exit_code=3)


@pytest.fixture
def adb() -> Iterator[tuple[FakeAdbServer, AdbServer]]:
    with FakeAdbServer() as fake:
        yield fake, AdbServer("127.0.0.1", fake.port)


def shell(adb: tuple[FakeAdbServer, AdbServer], features: str | None = None,
          timeout_s: float = 10.0, **commands: ShellResult) -> PhoneShell:
    fake, server = adb
    phone = FakePhone("P1", commands=dict(commands))
    if features is not None:
        phone.features = features
    fake.plug(phone)
    return PhoneShell(server.device("P1"), timeout_s=timeout_s)


def test_v2_keeps_stdout_stderr_and_the_exit_code(adb) -> None:
    assert shell(adb, x=ANSWER).run("x") == ShellOutput(3, "out\r\n", "err\n")


def test_without_shell_v2_the_answer_is_still_read(adb) -> None:
    """v1 merges stderr into stdout and has no exit status but the one echoed after it; an old
    adbd's pty ends lines with CRLF."""
    assert shell(adb, features="cmd", x=ANSWER).run("x") == ShellOutput(3, "out\nerr\n", "")
    assert shell(adb, features="cmd").run("echo hi") == ShellOutput(0, "hi\n", "")


@pytest.mark.parametrize("features", [None, "cmd"])
def test_a_command_that_keeps_printing_times_out_as_a_whole(adb, features) -> None:
    slow = ShellResult(stdout=b"x" * 40, trickle_s=0.05)  # 2 s in all, a byte every 50 ms
    phone = shell(adb, features=features, timeout_s=0.5, slow=slow)
    started = time.monotonic()
    with pytest.raises(PhoneCommandError, match=r"phone P1: `slow` did not finish in 0.5 s"):
        phone.run("slow")
    assert time.monotonic() - started < 1.5


def test_an_answer_cut_short_names_the_phone_and_the_command(adb) -> None:
    phone = shell(adb, getprop=ShellResult(stdout=b"[ro.product.model]: [Pix", cut=True))
    with pytest.raises(PhoneCommandError, match=r"phone P1: `getprop` ended without an exit"):
        phone.run("getprop")


def test_an_answer_larger_than_the_limit_is_refused(adb) -> None:
    phone = shell(adb, big=ShellResult(stdout=b"y" * 3 * 2**20))
    phone.max_bytes = 2**20
    with pytest.raises(PhoneCommandError, match=r"`big` printed more than 1 MiB"):
        phone.run("big")
    phone.max_bytes = 4 * 2**20
    assert len(phone.run("big").stdout) == 3 * 2**20
