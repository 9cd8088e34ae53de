"""A stop asked for at any point of a session's life ends the agent: here while the session is
being made, before request_stop can find it to leave (a SIGTERM right after start, as the ADB
bridge sends when it stops; the PS holds the stream open until the device goes)."""

from __future__ import annotations

import threading

import pytest

from testbed.adb_bridge.doctor import ThrowawayPS
from testbed.agent import agent as agent_module
from testbed.agent.agent import Agent, AgentOptions

TOKEN = "t0ken-" + "5" * 26


def test_a_stop_while_the_session_is_made_ends_the_agent(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    ps = ThrowawayPS(TOKEN, hold=True).start()
    try:
        agent = Agent(AgentOptions(ps_address=f"127.0.0.1:{ps.port}", token=TOKEN, name="a",
                                   kind="real"))
        made = agent_module._Session.__init__

        def made_then_stopped(self: object, owner: Agent) -> None:
            made(self, owner)  # type: ignore[arg-type]
            owner.request_stop("SIGTERM")  # the signal lands before run() files the session
        monkeypatch.setattr(agent_module._Session, "__init__", made_then_stopped)
        done = threading.Event()
        threading.Thread(target=lambda: (agent.run(), done.set()), daemon=True).start()
        assert done.wait(10), "the agent did not end after a stop"
    finally:
        ps.stop()
