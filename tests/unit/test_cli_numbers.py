"""Numbers on the command line: each option's range is checked by the parser, before the
command starts (exit 2, naming the option), where a --passes of 0 failed at the end of a sweep,
a --bins of 0 divided by zero and a --seed of -1 failed inside numpy."""

from __future__ import annotations

import argparse
import math

import pytest

from testbed.churn.generate import MAX_GENERATED_EVENTS, SessionModel, generate_events
from testbed.cli import main
from testbed.units import SEED, int_arg, number_arg
from tests.conftest import REPO, closed_port

DEFAULT = str(REPO / "topologies/default.yaml")
TRACE = str(REPO / "traces/flaky-phones.csv")


def test_int_arg_and_number_arg_take_their_range_and_refuse_the_rest() -> None:
    one_to_ten = int_arg(1, 10)
    assert [one_to_ten("1"), one_to_ten("10"), one_to_ten(" 7 ")] == [1, 10, 7]
    for text in ("0", "11", "-1", "2.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            one_to_ten(text)
    fraction = number_arg(0, 1, above_low=True)
    assert fraction("1") == 1.0 and fraction("1e-9") == 1e-9
    for text in ("0", "-0.1", "1.01", "nan", "inf", "-inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            fraction(text)
    assert number_arg(0, 5)("0") == 0.0
    assert SEED("0") == 0 and SEED(str(2**63 - 1)) == 2**63 - 1
    with pytest.raises(argparse.ArgumentTypeError, match="got -1"):
        SEED("-1")


@pytest.mark.parametrize("argv, option", [
    (["perf", "measure", "--passes", "0"], "--passes"),
    (["perf", "measure", "--repeats", "0"], "--repeats"),
    (["perf", "measure", "--min-sample-s", "nan"], "--min-sample-s"),
    (["perf", "measure", "--seed", "-1"], "--seed"),
    (["perf", "measure", "--threads", "0"], "--threads"),
    (["adb", "measure", "S", "--limit", "-1", "--adb", "127.0.0.1:{port}"], "--limit"),
    (["adb", "measure", "S", "--passes", "0", "--adb", "127.0.0.1:{port}"], "--passes"),
    (["adb", "devices", "--phone-port", "65535"], "--phone-port"),
    (["trace", "show", TRACE, "--topology", DEFAULT, "--bins", "0"], "--bins"),
    (["trace", "gen", "--topology", DEFAULT, "--duration", "10s", "--session-mean", "1s",
      "--absence-mean", "1s", "--seed", "-1"], "--seed"),
    (["simulate", DEFAULT, "--ps-gemm-s", "-1"], "--ps-gemm-s"),
    (["compare", DEFAULT, "--simulate", "--pue", "0.5"], "--pue"),
    (["net", "check", DEFAULT, "--tolerance", "0"], "--tolerance"),
    (["up", DEFAULT, "--join-timeout", "nan"], "--join-timeout"),
])
def test_an_option_out_of_its_range_exits_2_before_anything_starts(
        argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    # adb measure would fail on the closed port (exit 1) had it got that far
    argv = [a.format(port=closed_port()) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected" in err, err


def test_trace_gen_refuses_a_duration_that_would_make_too_many_events() -> None:
    model = SessionModel(session_mean_s=1e-3, absence_mean_s=1e-3)
    with pytest.raises(ValueError, match="make about 28,800,000,000,000 events"):
        generate_events([f"d{i}" for i in range(8)], model, 3.6e9, seed=0)  # at once
    # just within the limit, it is generated (about that many events)
    duration_s = MAX_GENERATED_EVENTS / 2 / 8 * 2.0 / 20  # a twentieth of it, to stay quick
    events = generate_events([f"d{i}" for i in range(8)], SessionModel(1.0, 1.0), duration_s,
                             seed=0)
    assert math.isclose(len(events), MAX_GENERATED_EVENTS / 20, rel_tol=0.05)
