"""`testbed adb doctor`'s throwaway PS says its join check is done as soon as the Stop it
answers has gone out and the stream ended, even when the agent that takes the Stop closes its
stream at once: the server then never resumes the Work generator past its Stop, and the doctor
waited out its 60 s join timeout for a check that had passed (66 s for one doctor test in CI
where it takes 7 s)."""

from __future__ import annotations

import grpc

from testbed.adb_bridge.doctor import ThrowawayPS
from testbed.wire import testbed_pb2 as pb
from testbed.wire import testbed_pb2_grpc as pb_grpc

TOKEN = "t0ken-" + "6" * 26
TRIES = 50  # the old generator missed about 1 in 15 on a 2-core host


def test_done_when_the_agent_hangs_up_right_after_the_stop() -> None:
    missed = 0
    for _ in range(TRIES):
        ps = ThrowawayPS(TOKEN).start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{ps.port}") as channel:
                stub = pb_grpc.ParameterServerStub(channel)
                stub.Join(pb.JoinRequest(token=TOKEN, device=pb.DeviceDescriptor(name="a")))
                call = stub.Work(iter([pb.DeviceMessage()]))
                first = next(call)
                call.cancel()  # as an agent that exits on Stop
            assert first.HasField("stop")
            missed += not ps.done.wait(2.0)
            assert ps.joined == "a" and ps.stopped
        finally:
            ps.stop()
    assert missed == 0, f"{missed} of {TRIES} join checks not done within 2 s of the Stop"
