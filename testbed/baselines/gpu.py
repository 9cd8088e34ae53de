"""The cloud GPU reference: one datacenter GPU training the same job, from its datasheet.

Step time (a roofline with a sustained share of peak; symbols of :mod:`testbed.baselines.cost`)::

    t_step = F_gemm / (peak_fp32_flops · sustained_fraction) + B_mem / memory_bytes_s
    E_step = board_power_w · t_step · PUE

``F_gemm`` is every GEMM of the step (attention products included), ``B_mem`` the memory-bound
work (norms, softmax, AdamW). The board is charged at its full rated power for the whole step
(an upper bound on the GPU's own draw; the host around it is not counted, as the phones' PS is
not). Figures and sources: ``testbed/baselines/data/gpu_<name>.yaml``.

A GPU file (``--gpu FILE``) holds exactly the keys of :class:`GpuProfile` (``memory`` as a size
with its unit, the rest plain numbers), each checked before any strategy runs: a finite number
in :data:`RANGES`, ``sustained_fraction`` in (0, 1]. Every problem is listed at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testbed import units
from testbed.baselines import cost
from testbed.errors import InputError
from testbed.topology import JobSpec
from testbed.user_paths import is_file, load_user_yaml, read_user_text

DATA = Path(__file__).resolve().parent / "data"
MAX_GPU_FILE_BYTES = 64 * 1024  # a dozen lines of figures and their sources
MAX_NAME_CHARS = 64  # the GPU row's strategy column is gpu:<name>
MAX_DESCRIPTION_CHARS = 1024
# Each number's range, (above, at most): above 0 (every one divides or multiplies a step), at
# most some hundred times today's largest board (an H100: 67 TFLOPS fp32, 3.35 TB/s, 700 W), so
# a mistyped exponent is caught.
RANGES = {"peak_fp32_flops": (0.0, 1e17), "memory_bytes_s": (0.0, 1e15),
          "board_power_w": (0.0, 1e5), "sustained_fraction": (0.0, 1.0)}
REQUIRED = ("name", "peak_fp32_flops", "memory", "memory_bytes_s", "board_power_w",
            "sustained_fraction")
OPTIONAL = ("description",)


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
    """A shipped GPU profile by name (``a5000``) or a YAML file of the same keys, checked
    whole (InputError naming ``--gpu``, the file and each key that is wrong)."""
    path = DATA / f"gpu_{name_or_path}.yaml"
    if not is_file(path):
        path = Path(name_or_path)
    source = f"--gpu {name_or_path}"
    try:
        raw = load_user_yaml(read_user_text(path, MAX_GPU_FILE_BYTES))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        shipped = ", ".join(sorted(p.stem[4:] for p in DATA.glob("gpu_*.yaml")))
        raise InputError(source, [f"not a readable GPU YAML file ({why}); expected a shipped "
                                  f"name ({shipped}) or a file of the same keys"]) from None
    if not isinstance(raw, dict):
        raise InputError(source, [f"expected a mapping of {', '.join(REQUIRED)}, got "
                                  f"{type(raw).__name__}"])
    problems = [f"{key}: unknown key; expected {', '.join(REQUIRED + OPTIONAL)}"
                for key in raw if key not in REQUIRED + OPTIONAL]
    problems += [f"{key}: missing" for key in REQUIRED if key not in raw]
    numbers = {key: _number(key, raw[key], problems) for key in RANGES if key in raw}
    memory_bytes = 0
    if "memory" in raw:
        try:
            memory_bytes = units.parse_size_bytes(raw["memory"])
        except units.UnitError as exc:
            problems.append(f"memory: {exc}")
        else:
            if memory_bytes <= 0:
                problems.append(f"memory: expected a size above 0, got {raw['memory']!r}")
    texts = {}
    for key, most in (("name", MAX_NAME_CHARS), ("description", MAX_DESCRIPTION_CHARS)):
        value = raw.get(key, "")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # name: 4090
        if not isinstance(value, str) or not value.isprintable() or len(value) > most or \
                (key == "name" and key in raw and not value):
            problems.append(f"{key}: expected one line of text, at most {most} characters, "
                            f"got {str(value)[:40]!r}")
        texts[key] = value
    if problems:
        raise InputError(source, problems)
    return GpuProfile(texts["name"], texts["description"], numbers["peak_fp32_flops"],
                      memory_bytes, numbers["memory_bytes_s"], numbers["board_power_w"],
                      numbers["sustained_fraction"])


def _number(key: str, value: Any, problems: list[str]) -> float:
    """``value`` as a float in RANGES[key], else 0.0 and a problem added (YAML reads 27.8e12,
    with no sign in its exponent, as a string: such a string is a number here)."""
    above, at_most = RANGES[key]
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except ValueError:
            pass
    if not above < number <= at_most:  # NaN fails every comparison
        problems.append(f"{key}: expected a finite number above {above:g} and at most "
                        f"{at_most:g}, got {value!r}")
        return 0.0
    return number


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
