"""Two machines that share a host name (`testbed join`'s default name) join one run: real agent
processes asking one name, a real PS, real gRPC on loopback. The PS numbers the second one's
name, the run waits for both and trains on both, and every record tells them apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.runlog import read_jsonl
from tests.adversarial.psproc import PsProcess, job_topology
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_two_agents_asking_one_name_train_as_two_devices(tmp_path: Path) -> None:
    steps = 2
    topology = job_topology(tmp_path, steps=steps)
    logs = [tmp_path / f"agent-{i}.log" for i in range(2)]
    with PsProcess(topology, tmp_path / "run", "--expect-devices", "2") as ps:
        for log in logs:
            with log.open("w") as out:
                ps.agents.append(subprocess.Popen(
                    [sys.executable, "-m", "testbed.agent", "--ps", ps.address, "--name",
                     "twin", "--kind", "real"], env=ps.env, cwd=REPO, stdout=out,
                    stderr=subprocess.STDOUT))
        code, output = ps.finish()
        assert code == 0, output
        for agent in ps.agents:
            assert agent.wait(60) == 0
    ps.assert_losses_match(steps)
    joins = {e["device"]: e for e in ps.events() if e["event"] == "join"}
    assert set(joins) == {"twin", "twin-2"}, joins
    assert "asked_name" not in joins["twin"] and joins["twin-2"]["asked_name"] == "twin"
    # the PS started with both: it counted two devices attached, not one name
    (started,) = [e for e in ps.events() if e["event"] == "training_start"]
    assert started["devices"] == 2, started
    records = {r["device"]: r for r in read_jsonl(ps.run_dir / "devices.jsonl")}
    assert set(records) == {"twin", "twin-2"}
    assert all(r["tiles_done"] > 0 for r in records.values()), records
    said = [log.read_text() for log in logs]
    assert sum("this one is twin-2 in the run's records" in text for text in said) == 1, said
