"""A checkpoint written to a disk that fills: the error says the disk is full (torch's writer
said 'unexpected pos 571264 vs 571152', which a run then printed as its one line), the
temporary is gone, and the checkpoint before it stays."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest
import torch

from testbed import user_paths
from testbed.errors import out_of_room
from testbed.ps_backend.engine import checkpoint


class FillingFile(io.RawIOBase):
    """A file on a disk with ``room`` bytes left: writes past it fail as the kernel's do."""

    def __init__(self, fd: int, room: int):
        self.fd, self.room = fd, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return os.write(self.fd, data)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


def fill_the_disk_after(room: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files the project's one atomic writer (user_paths.written_whole) opens from now on
    are on a disk with ``room`` bytes left."""
    def opened(file: Path, mode: str, newline: str | None = None) -> FillingFile:
        assert mode == "wb"
        return FillingFile(os.open(file, os.O_WRONLY | os.O_TRUNC), room)
    monkeypatch.setattr(user_paths, "open", opened, raising=False)


def test_a_full_disk_is_said_as_such_and_the_old_checkpoint_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    old = checkpoint.save_atomic(state, tmp_path / "step-000001.pt")
    fill_the_disk_after(50_000, monkeypatch)
    with pytest.raises(OSError) as raised:
        checkpoint.save_atomic(state, tmp_path / "step-000002.pt")
    assert raised.value.errno == errno.ENOSPC and out_of_room(raised.value)
    assert "No space left on device" in str(raised.value)
    assert "unexpected pos" not in str(raised.value)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]  # no temporary left
    assert torch.equal(torch.load(old, weights_only=True)["w"], state["w"])


def test_a_baseline_stage_checkpoint_on_a_full_disk_is_said_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline stage writes its checkpoint the same way (testbed.baselines.stage_proc)."""
    from testbed.baselines.stage_proc import save_checkpoint

    stage = torch.nn.Linear(256, 256)
    stage.first = 0  # its first layer's index in the model
    opt = torch.optim.AdamW(stage.parameters())
    stage(torch.ones(2, 256)).sum().backward()
    opt.step()
    path = tmp_path / "step2" / "stage0.pt"
    save_checkpoint(stage, opt, path)
    before = torch.load(path, weights_only=True)
    fill_the_disk_after(50_000, monkeypatch)
    with pytest.raises(OSError) as raised:
        save_checkpoint(stage, opt, path)
    assert raised.value.errno == errno.ENOSPC and out_of_room(raised.value)
    assert str(path) in str(raised.value) and "unexpected pos" not in str(raised.value)
    monkeypatch.undo()
    assert sorted(p.name for p in path.parent.iterdir()) == ["stage0.pt"]  # no temporary
    after = torch.load(path, weights_only=True)
    assert torch.equal(after["params"]["weight"], before["params"]["weight"])
