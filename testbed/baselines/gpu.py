"""The cloud GPU reference: one datacenter GPU training the same job, from its datasheet.

Step time (a roofline with a sustained share of peak; symbols of :mod:`testbed.baselines.cost`)::

    t_step = F_gemm / (peak_fp32_flops · sustained_fraction) + B_mem / memory_bytes_s
    E_step = board_power_w · t_step · PUE

``F_gemm`` is every GEMM of the step (attention products included), ``B_mem`` the memory-bound
work (norms, softmax, AdamW). The board is charged at its full rated power for the whole step
(an upper bound on the GPU's own draw; the host around it is not counted, as the phones' PS is
not). Figures and sources: ``testbed/baselines/data/gpu_<name>.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from testbed import units
from testbed.baselines import cost
from testbed.errors import InputError
from testbed.topology import JobSpec

DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class GpuProfile:
    name: str
    description: str
    peak_fp32_flops: float
    memory_bytes: int
    memory_bytes_s: float
    board_power_w: float
    sustained_fraction: float


def load_gpu(name_or_path: str) -> GpuProfile:
    """A shipped GPU profile by name (``a5000``) or a YAML file of the same keys."""
    path = DATA / f"gpu_{name_or_path}.yaml"
    if not path.is_file():
        path = Path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
        return GpuProfile(str(raw["name"]), str(raw.get("description", "")),
                          float(raw["peak_fp32_flops"]), units.parse_size_bytes(raw["memory"]),
                          float(raw["memory_bytes_s"]), float(raw["board_power_w"]),
                          float(raw["sustained_fraction"]))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        shipped = sorted(p.stem[4:] for p in DATA.glob("gpu_*.yaml"))
        raise InputError(str(name_or_path), [f"not a GPU profile (shipped: {shipped}): "
                                             f"{exc}"]) from None


@dataclass(frozen=True)
class GpuStep:
    step_s: float
    energy_j: float  # per step, PUE included
    fits: bool  # weights, gradients, Adam and the batch's activations within its memory
    need_bytes: int


def gpu_step(job: JobSpec, gpu: GpuProfile, pue: float = 1.0) -> GpuStep:
    """Time and energy of one training step of ``job`` on ``gpu``."""
    t = cost.step_gemm_flops(job) / (gpu.peak_fp32_flops * gpu.sustained_fraction) + \
        cost.step_elementwise_bytes(job) / gpu.memory_bytes_s
    need = cost.replica_bytes(job, job.batch_size)
    return GpuStep(t, gpu.board_power_w * t * pue, need <= gpu.memory_bytes, need)
