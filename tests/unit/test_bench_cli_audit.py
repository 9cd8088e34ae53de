"""The bench scripts as a new user meets them: `--help` explains the script (its whole
docstring, not its first line) and every option, and every script has a `--quick` mode that
keeps an option the user gave."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


def _bench(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """bench/<name>.py imported as a module of its own (bench/ on the path, as when run)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_audit_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


class _Parsed(Exception):
    """Raised instead of parsing: the parser is all a test needs."""


def _parser(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> argparse.ArgumentParser:
    """The parser the script's main builds."""
    seen: list[argparse.ArgumentParser] = []

    def parse_args(self: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        seen.append(self)
        raise _Parsed
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    with pytest.raises(_Parsed):
        module.main([])
    return seen[0]


def test_every_bench_script_is_checked() -> None:
    # the glob found them (an empty parametrization would pass without checking any); a new
    # script is checked as it lands
    assert len(SCRIPTS) >= 14 and "headline" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_explains_the_script_and_every_option(monkeypatch: pytest.MonkeyPatch,
                                                   name: str) -> None:
    """`--help` gave the docstring's first line (sim_vs_emu's stopped mid-sentence: '...
    emulated (`testbed up`, real processes) and simulated') and options such as `--devices
    DEVICES`, `--steps STEPS` and `--sizes SIZES` with no word on what they take."""
    module = _bench(monkeypatch, name)
    parser = _parser(monkeypatch, module)
    assert parser.description == module.__doc__
    assert parser.formatter_class is argparse.RawDescriptionHelpFormatter
    bare = [a.option_strings or [a.dest] for a in parser._actions if a.help is None]
    assert not bare, f"bench/{name}.py: options without help: {bare}"
    assert "--quick" in parser._option_string_actions, f"bench/{name}.py has no --quick"


def test_operand_digest_quick_prints_every_hash(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    module = _bench(monkeypatch, "operand_digest")
    assert module.main(["--quick", "--rows", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("256 x 3072 float32")
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["BLAKE2b", "CRC-32", "XXH3-64"]


def test_sim_to_real_quick_is_short_and_keeps_what_was_given(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    module = _bench(monkeypatch, "sim_to_real")
    seen: list[tuple[str, int, int]] = []

    def run_device(kind: str, args: argparse.Namespace) -> tuple[list[float], float]:
        seen.append((kind, args.steps, args.tokens))
        return [0.1] * args.steps, 0.05
    monkeypatch.setattr(module, "run_device", run_device)
    assert module.main(["--quick"]) == 0
    assert seen == [("real", 2, 256), ("emulated", 2, 256)]  # one round
    seen.clear()
    assert module.main(["--quick", "--steps", "3", "--rounds", "2"]) == 0
    assert seen == [("real", 3, 256), ("emulated", 3, 256)] * 2
    seen.clear()
    assert module.main([]) == 0
    assert seen == [("real", 5, 1024), ("emulated", 5, 1024)] * 2
    assert "median step" in capsys.readouterr().out


def test_mininet_scale_quick_is_one_small_size(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    module = _bench(monkeypatch, "mininet_scale")
    sizes: list[tuple[int, float]] = []

    class Probe:
        delay_mechanism = "netem"

        def missing(self) -> list[str]:
            return []

    def run(n: int, work: Path, settle_s: float, launch: str) -> dict[str, float]:
        sizes.append((n, settle_s))
        return {k: 0.0 for k in ("bringup_s", "ps_start_s", "started_s", "joined_s",
                                 "teardown_s", "rss_mb", "pss_mb", "uss_mb", "max_rss_mb",
                                 "ps_rss_mb", "shell_rss_mb", "agent_cpu_s")} | {
            "n": n, "rejoins": 0}
    monkeypatch.setattr(module, "probe", Probe)
    monkeypatch.setattr(module, "run", run)
    monkeypatch.setattr(module, "RESERVE_BYTES", 0)  # whatever memory this host has free
    monkeypatch.setattr(module, "EST_BYTES_PER_DEVICE", 1)
    assert module.main(["--quick"]) == 0
    assert sizes == [(20, 2.0)]
    sizes.clear()
    assert module.main(["--quick", "--sizes", "30"]) == 0
    assert sizes == [(30, 2.0)]


def test_churn_quick_rates_make_devices_leave(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """At 10 %/min none of --quick's 6 devices left in its 30 s window: the row of a churning
    rate was the no-churn one, with no recovery latency to print."""
    module = _bench(monkeypatch, "churn")
    rates: list[float] = []

    def run_rate(rate: float, args: argparse.Namespace, work: Path) -> dict[str, Any]:
        rates.append(rate)
        phones = args.devices - max(1, args.devices // 5)  # as run_rate makes the trace
        trace = module.churn_trace(phones, rate, args.duration_s, args.absence_s, seed=7)
        departures = trace.count(",crash,") + trace.count(",leave,")
        assert departures > 0 or rate == 0, rate
        return {"rate": rate, "steps": 1, "median_step_s": 1.0, "mean_step_s": 1.0,
                "departures": departures, "requeued": 0, "recomputed": 0,
                "recovery_p50_s": None, "recovery_p95_s": None, "goodput": 1.0, "backups": 0,
                "validation_us": 1.0, "validation_cpu_share": 0.01}
    monkeypatch.setattr(module, "run_rate", run_rate)
    monkeypatch.setattr(module, "validation_micro", lambda repeats: [])
    assert module.main(["--quick"]) == 0
    assert rates == [0.0, 30.0, 100.0]
    rates.clear()
    assert module.main(["--quick", "--rates", "0,50"]) == 0
    assert rates == [0.0, 50.0]
    assert "churn bench: 6 devices, 30 s window" in capsys.readouterr().out


class _Row(dict):  # type: ignore[type-arg]
    """A setting's figures, every one 0 (no probe)."""

    def __missing__(self, key: str) -> float:
        return 0.0


def test_emulation_fidelity_quick_leaves_out_the_memory_hungry_setting(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--quick ran 240 agents ('many, adaptive'), and on a host with 3.1 GB free the bench's
    process was killed for memory (exit 137) after 149 s: a smoke run must not."""
    module = _bench(monkeypatch, "emulation_fidelity")
    labels: list[tuple[str, int]] = []

    def run_setting(label: str, agents: int, *_: Any, **__: Any) -> dict[str, Any]:
        labels.append((label, agents))
        return _Row(probe_d=None, agents=agents)
    monkeypatch.setattr(module, "run_setting", run_setting)
    monkeypatch.setattr(module, "calibrate_host_gflops",
                        lambda: {"host_gflops": 100.0, "single_thread_gflops": 50.0,
                                 "cores": 2.0})
    assert module.main(["--quick"]) == 0
    assert [agents for _, agents in labels] == [2, 2, 16, 16]
    assert "left out by --quick" in capsys.readouterr().out
    labels.clear()
    assert module.main(["--quick", "--only", "many"]) == 0
    assert labels == [("many, adaptive", 240)]


def test_stage_profile_quick_says_the_model_was_cut(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """'hotcarbon: one step, simulated in 3.0 s' headed figures of 2 of its 12 layers."""
    module = _bench(monkeypatch, "stage_profile")
    tiny = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
    assert module.main([str(tiny), "--quick"]) == 0
    assert capsys.readouterr().out.startswith("tiny (--quick: 2 of its 2 layers): one step")


@pytest.mark.parametrize("name, argv, said", [
    ("churn", ["--rates", "abc"], "argument --rates: 'abc': expected a number"),
    ("simulate_scale", ["--models", "opt-125m,bogus"],
     "argument --models: 'bogus': expected one of opt-125m, opt-1.3b"),
    ("simulate_scale", ["--devices", "100,x"], "argument --devices: 'x': expected a whole number"),
])
def test_a_bad_list_value_is_the_parsers_error_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str,
        argv: list[str], said: str) -> None:
    module = _bench(monkeypatch, name)
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
