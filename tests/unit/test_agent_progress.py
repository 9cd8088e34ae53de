"""A device that joined a run on another machine (`testbed join`) says what it has computed
every minute: from its join to the run's end it said nothing, for hours on an OPT-125m job."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from testbed.agent.agent import Agent, AgentOptions, progress_line

ADDRESS = "127.0.0.1:50999"  # never connected to


def test_the_line_says_the_tiles_and_why_there_may_be_none() -> None:
    assert progress_line("lab-1", 1, 1, 60, True) == \
        "lab-1: 1 tile computed, 1 in the last 60 s"
    assert progress_line("lab-1", 120, 20, 60, True) == \
        "lab-1: 120 tiles computed, 20 in the last 60 s"
    idle = progress_line("lab-1", 120, 0, 60, True)
    assert idle.startswith("lab-1: 120 tiles computed, none in the last 60 s (") \
        and "link or CPU" in idle
    assert progress_line("lab-1", 120, 0, 60, False) == \
        "lab-1: 120 tiles computed; not in the run at the moment (joining again)"


def test_an_agent_with_progress_says_it_until_it_stops(caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent(AgentOptions(ps_address=ADDRESS, token="t", name="lab-1", progress_s=0.05))
    caplog.set_level(logging.INFO, logger="testbed.agent")
    reporter = threading.Thread(target=agent._say_progress, args=(0.05,))
    reporter.start()
    agent.tiles_done = 7
    time.sleep(0.3)
    agent.stopping.set()
    reporter.join(5)
    assert not reporter.is_alive()  # it ends with the agent
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lab-1: ")]
    assert any(line.startswith("lab-1: 7 tiles computed") for line in lines), lines
    count = len(lines)
    time.sleep(0.15)
    assert len([r for r in caplog.records if r.getMessage().startswith("lab-1: ")]) == count


@pytest.mark.parametrize("value", ["-1", "nan", "1e9"])
def test_a_progress_interval_out_of_range_is_refused(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.agent.__main__ import main as agent_main

    with pytest.raises(SystemExit) as exit_:
        agent_main(["--ps", ADDRESS, "--name", "x", "--token", "t", "--progress-s", value])
    assert exit_.value.code == 2
    assert "argument --progress-s: expected a number from 0 to 86400" in capsys.readouterr().err
