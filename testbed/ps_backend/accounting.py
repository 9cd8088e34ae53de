"""What a step cost, counted once: the PS and `testbed simulate` fill the same object.

A step's :class:`StepStats` is filled as results arrive; at the end of the step the run's
totals absorb it (:meth:`StepStats.add`), so a figure is never counted in two places.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class StepStats:
    """What one training step cost, as the PS (or the simulation) counted it."""

    tiles: int = 0
    recomputed: int = 0
    requeued: int = 0
    rejected: int = 0
    late: int = 0
    gemms_offloaded: int = 0
    gemms_local: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    lag_s_max: float = 0.0
    device_compute_s: float = 0.0
    energy_j: float = 0.0
    failed_checks: int = 0
    backups: int = 0
    backup_wins: int = 0
    wasted: int = 0
    from_ledger: int = 0  # tiles served from the ledger after a restart
    # per emulated tile of this step (kept on the step's stats only, never on the totals):
    # device-side error (hold / (D x compute_s) - 1) and lateness in wall seconds
    tile_errors: list[float] = field(default_factory=list)
    tile_lags_s: list[float] = field(default_factory=list)
    # device seconds past the model's time, per (GEMM, device): lateness_shares' input.
    # compute holds (tile_error's), tile starts and results' uplink (DeviceTimeline's; signed)
    tile_late_s: dict[tuple[str, str], float] = field(default_factory=dict)
    start_late_s: dict[tuple[str, str], float] = field(default_factory=dict)
    uplink_late_s: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def late_s(self) -> dict[str, dict[tuple[str, str], float]]:
        """The three lateness maps by kind (``dilation.LATENESS_KINDS``), for
        ``lateness_shares``."""
        return {"compute": self.tile_late_s, "start": self.start_late_s,
                "uplink": self.uplink_late_s}

    def add(self, step: StepStats) -> None:
        """Absorb one step's figures into these totals (sums; the largest lag; per-tile lists
        and maps stay with the step)."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, (list, dict)):
                continue
            theirs = getattr(step, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "lag_s_max" else mine + theirs)


def run_figures(totals: StepStats) -> dict[str, int | float]:
    """The summary's figures of the run that ``steps.jsonl`` also has per step, under the
    summary's keys (the same in ``testbed up``'s and ``testbed simulate``'s): sums, and the
    largest ``max_lag_s``. ``totals``: the finished steps' figures for a run that is done, so
    that each equals the sum over its steps; those and the step under way for one that was
    interrupted or failed (it spent them)."""
    return {"tiles": totals.tiles, "recomputed_tiles": totals.recomputed,
            "requeued_tiles": totals.requeued, "rejected": totals.rejected,
            "late": totals.late, "bytes_down": totals.bytes_down, "bytes_up": totals.bytes_up,
            "max_lag_s": round(totals.lag_s_max, 6),
            "device_compute_s": round(totals.device_compute_s, 6),
            "energy_j": round(totals.energy_j, 6), "failed_checks": totals.failed_checks,
            "backups": totals.backups, "backup_wins": totals.backup_wins,
            "wasted_tiles": totals.wasted}


def after_last_step(stats: StepStats) -> dict[str, int | float]:
    """What the PS counted after a done run's last step and before its summary (results of
    losing copies coming back late, a departure's ...): the non-zero figures of
    :func:`run_figures`, which leaves them out of a done run's totals."""
    return {key: value for key, value in run_figures(stats).items() if value}
