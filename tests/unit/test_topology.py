"""The topology schema: every problem reported with its YAML path; units; CLI exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed import units
from testbed.cli import main
from testbed.topology import TopologyError, load_topology, parse_topology

REPO = Path(__file__).resolve().parents[2]


def minimal() -> dict:
    return {"name": "t", "devices": [{"group": "phones", "profile": "snapdragon888", "count": 2,
                                      "link": {"down": "100Mbit", "up": "20Mbit"}}],
            "job": {"model": {"hidden": 32, "layers": 1, "heads": 2, "ffn": 64, "seq_len": 8}}}


@pytest.mark.parametrize("text,bps", [("20Mbit", 20e6), ("1Gbit", 1e9), ("10MB/s", 80e6),
                                      ("1.5Kbit", 1500.0), ("2MiB/s", 2 * 8 * 1024**2)])
def test_rates(text: str, bps: float) -> None:
    assert units.parse_rate_bps(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["20", 20, "20Mbits", "-1Mbit", "fast", True, None])
def test_bad_rates_are_refused(bad: object) -> None:
    with pytest.raises(units.UnitError):
        units.parse_rate_bps(bad)


def test_durations_fractions_sizes() -> None:
    assert units.parse_duration_s("10ms") == pytest.approx(0.01)
    assert units.parse_fraction("0.5%") == pytest.approx(0.005)
    assert units.parse_size_bytes("2GiB") == 2 * 1024**3
    with pytest.raises(units.UnitError):
        units.parse_fraction("150%")


def test_shipped_topologies_validate() -> None:
    for path in sorted((REPO / "topologies").glob("*.yaml")):
        topo = load_topology(path)
        assert topo.devices, path


def test_default_expands_devices() -> None:
    topo = load_topology(REPO / "topologies" / "default.yaml")
    names = [d.name for d in topo.devices]
    assert names[:2] == ["phones-0", "phones-1"] and len(names) == 8
    assert topo.devices[0].link.up_bps == 20e6


def test_every_problem_is_reported_with_its_path() -> None:
    raw = minimal()
    raw["bogus"] = 1  # unknown key
    raw["devices"][0]["count"] = -3  # negative count
    raw["devices"][0]["profile"] = "no-such-phone"  # missing profile
    raw["devices"][0]["link"]["up"] = "20Mbits"  # bad unit
    raw["job"]["batch_size"] = "eight"  # wrong type
    with pytest.raises(TopologyError) as info:
        parse_topology(raw, "t.yaml")
    problems = info.value.problems
    expected = {"bogus": "unknown key", "devices[0].count": "must not be negative",
                "devices[0].profile": "no device profile", "devices[0].link.up": "Mbits",
                "job.batch_size": "expected int"}
    for path, words in expected.items():
        assert any(p.startswith(f"{path}:") and words in p for p in problems), (path, problems)
    assert len(problems) == len(expected)


def test_switch_references_and_tree() -> None:
    raw = minimal()
    raw["network"] = {"switches": ["core", "ap0"], "ps": {"switch": "core"},
                      "links": [{"switches": ["core", "nope"], "down": "1Gbit", "up": "1Gbit"}]}
    raw["devices"][0]["switch"] = "ap9"
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    text = str(info.value)
    assert "network.links[0].switches" in text and "devices[0].switch: unknown switch" in text


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("adb, said", [
    ({"enabled": True}, ", adb: every phone the server at 127.0.0.1:5037 lists in state device)"),
    ({"enabled": True, "server": "127.0.0.1:5038", "serials": ["R58M12ABCDE", "PHONE2"]},
     ", adb: phones R58M12ABCDE, PHONE2 of 127.0.0.1:5038)"),
    ({"enabled": False}, "strategy tile-tp)"),
])
def test_validate_names_the_phones_an_adb_section_adds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], adb: dict, said: str) -> None:
    # the line counted the emulated devices alone: "ok (2 devices in 1 group, ...)" said nothing
    # of the phones a run waits for
    raw = {**minimal(), "network": {"backend": "loopback"}, "adb": adb}
    assert main(["validate", str(_write(tmp_path, raw))]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(said), out


def test_validate_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = minimal()  # one group
    one["devices"][0]["count"], one["job"]["steps"] = 1, 1
    assert main(["validate", str(_write(tmp_path, one))]) == 0
    out = capsys.readouterr().out
    assert "ok (1 device in 1 group, 1 step," in out
    # the model's size, as the engine builds it (test_engine counts a built model's)
    from testbed.topology import load_topology
    n = load_topology(_write(tmp_path, one)).job.model.parameters
    assert n > 1000
    assert any(f", a model of {n / unit:.1f} {name} parameters, " in out
               for unit, name in ((1e3, "k"), (1e6, "M")))
    # a group of none is not counted as one the devices are in ("2 devices in 2 groups")
    empty = minimal()
    empty["devices"].append({**empty["devices"][0], "group": "spare", "count": 0})
    assert main(["validate", str(_write(tmp_path, empty))]) == 0
    assert " in 1 group (no devices in spare), " in capsys.readouterr().out
    assert main(["validate", str(_write(tmp_path, minimal()))]) == 0
    raw = minimal()
    raw["devices"][0]["count"] = -1
    raw["job"]["steps"] = 0
    assert main(["validate", str(_write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert "devices[0].count" in err and "job.steps" in err and "topo.yaml" in err


def test_validate_reports_yaml_syntax_with_line(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ndevices: [\n")
    assert main(["validate", str(path)]) == 2
    assert "line" in capsys.readouterr().err


def test_up_on_a_broken_file_starts_nothing(tmp_path: Path) -> None:
    raw = minimal()
    raw["devices"][0]["link"]["down"] = "fast"
    out = tmp_path / "runs"
    assert main(["up", str(_write(tmp_path, raw)), "--out", str(out), "--no-live"]) == 2
    assert not out.exists()  # no run directory, so no process was started either


def test_a_profile_file_that_does_not_load_is_a_problem_of_the_topology(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """validate says what up and simulate would stop on, before either makes a run directory;
    a fixed profile is read again (the check is cached per version of the file)."""
    profile = tmp_path / "phone.yaml"
    profile.write_text("name: phone\nsustained_gflops: -5\n")
    raw = minimal()
    raw["devices"][0]["profile"] = "phone.yaml"  # relative to the topology's directory
    path = _write(tmp_path, raw)
    out = tmp_path / "runs"
    for argv in (["validate", str(path)], ["simulate", str(path), "--out", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "devices[0].profile: the profile" in err and "sustained_gflops" in err, err
    assert not out.exists()
    profile.write_text("name: phone\nsustained_gflops: 50\n")
    assert main(["validate", str(path)]) == 0


def test_binary_garbage_is_refused_with_the_file_named(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "garbage.yaml"
    path.write_bytes(bytes(range(128, 256)) * 4)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not a UTF-8 text file" in err


@pytest.mark.parametrize("where,value,path,words", [
    (("devices", 0, "link", "down"), "1e99Gbit", "devices[0].link.down", "at most 1000Gbit"),
    (("devices", 0, "link", "delay"), "1e99s", "devices[0].link.delay", "at most 60 s"),
    (("devices", 0, "link", "delay"), "1e999s", "devices[0].link.delay", "finite"),
    (("job", "model", "hidden"), 10**9, "job.model.hidden", "<= 65,536"),
    (("job", "model", "layers"), 10**6, "job.model.layers", "<= 1,024"),
    (("devices", 0, "count"), 100_000, "devices[0].count", "<= 10,000"),
    (("job", "optimizer"), {"lr": float("inf")}, "job.optimizer.lr", "finite"),
    (("job", "optimizer"), {"lr": float("nan")}, "job.optimizer.lr", "finite"),
    (("job", "optimizer"), {"lr": 10}, "job.optimizer.lr", "<= 1"),
    (("job", "parallelism"), {"min_offload_flops": float("-inf")},
     "job.parallelism.min_offload_flops", "finite"),
    (("devices", 0, "behaviour"), {"straggler": {"factor": 1e99}},
     "devices[0].behaviour.straggler.factor", "<= 1,000"),
    (("time_dilation",), float("inf"), "time_dilation", "[1, 10000]"),
    (("devices", 0, "cache"), 256, "devices[0].cache", "unit"),
    (("devices", 0, "cache"), "512KiB", "devices[0].cache", "between 1MiB and 64GiB"),
    (("devices", 0, "cache"), "100GiB", "devices[0].cache", "between 1MiB and 64GiB"),
    # names no file can have: each is one more problem, not a traceback from pathlib
    (("devices", 0, "profile"), "x" * 300, "devices[0].profile", "no device profile named"),
    (("devices", 0, "profile"), "a\0b", "devices[0].profile", "no device profile named"),
    (("devices", 0, "profile"), "~no-such-user-here/p.yaml", "devices[0].profile",
     "no device profile named"),
    (("job", "data"), {"files": ["x" * 300]}, "job.data.files[0]", "cannot be a file name"),
    (("job", "data"), {"files": ["~no-such-user-here/t.txt"]}, "job.data.files[0]",
     "no such file"),
])
def test_absurd_values_are_refused_with_their_path(where: tuple, value: object, path: str,
                                                   words: str) -> None:
    raw = minimal()
    node = raw
    for key in where[:-1]:
        node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    node[where[-1]] = value
    with pytest.raises(TopologyError) as info:
        parse_topology(raw, "t.yaml")
    problems = info.value.problems
    assert len(problems) == 1 and problems[0].startswith(f"{path}:") and words in problems[0], \
        problems


def test_a_model_too_big_for_any_ps_is_refused_though_each_size_is_allowed() -> None:
    from testbed.topology import MAX_PARAMETERS, model_parameters

    raw = minimal()
    raw["job"]["model"] = {"hidden": 65_536, "layers": 64, "heads": 64, "ffn": 65_536,
                           "seq_len": 128}
    assert model_parameters(65_536, 64, 65_536, 128, 256) > MAX_PARAMETERS
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    assert info.value.problems[0].startswith("job.model: ") and "parameters" in str(info.value)


def test_device_count_cap_holds_across_groups() -> None:
    raw = minimal()
    raw["devices"][0]["count"] = 6_000
    raw["devices"].append({**raw["devices"][0], "group": "more"})
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    assert info.value.problems == ["devices: 12,000 devices are more than the 10,000 one "
                                   "topology may hold"]


def test_yaml_inf_nan_and_string_floats_as_written_in_a_file(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    raw = minimal()
    raw["job"]["optimizer"] = {"lr": "3e-4"}  # YAML 1.1 reads 3e-4 as a string: accepted
    assert load_topology(_write(tmp_path, raw)).job.optimizer.lr == pytest.approx(3e-4)
    raw["job"]["optimizer"] = {"lr": "LR", "weight_decay": "WD"}
    path = tmp_path / "inf.yaml"  # .inf and .nan are YAML floats, as a user writes them
    path.write_text(yaml.safe_dump(raw).replace("LR", ".inf").replace("WD", ".nan"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "job.optimizer.lr: must be a finite number" in err
    assert "job.optimizer.weight_decay: must be a finite number" in err


def test_unknown_keys_name_the_expected_ones_and_types_are_strict() -> None:
    raw = minimal()
    raw["devices"][0]["link"]["jitter"] = "1ms"
    raw["job"]["model"]["layers"] = True  # a bool is not a count
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    assert info.value.problems == [
        "devices[0].link.jitter: unknown key (expected one of: down, up, delay, loss, queue)",
        "job.model.layers: expected int, got bool True"]


def test_a_section_of_another_part_lands_in_extra() -> None:
    from testbed.adb_bridge.config import AdbSpec
    from testbed.topology import SECTIONS

    assert "adb" in SECTIONS
    raw = minimal()
    assert "adb" not in parse_topology(raw).extra
    raw["adb"] = None  # the key alone: the section's defaults
    assert parse_topology(raw).extra["adb"] == AdbSpec()
    raw["adb"] = {"enabled": True, "serials": ["A1"]}
    spec = parse_topology(raw).extra["adb"]
    assert spec.enabled and spec.serials == ("A1",)


def test_a_group_may_set_its_devices_cache() -> None:
    raw = minimal()
    raw["devices"][0]["cache"] = "2MiB"
    assert parse_topology(raw).devices[0].group.cache_bytes == 2 * 1024**2
    assert parse_topology(minimal()).devices[0].group.cache_bytes is None  # the default


def test_data_files_shorter_than_one_window_are_refused_before_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The PS samples windows of seq_len + 1 bytes of the files together: fewer would stop a
    run after its network and PS started, so validate (and every run command) refuses them."""
    raw = minimal()  # seq_len 8: a window is 9 bytes
    (tmp_path / "a.txt").write_bytes(b"abcd")
    (tmp_path / "b.txt").write_bytes(b"efgh")
    raw["job"]["data"] = {"files": ["a.txt", "b.txt"]}
    assert main(["validate", str(_write(tmp_path, raw))]) == 2
    assert "data.files: 2 file(s) hold 8 bytes together; a window of model.seq_len + 1 = 9 " \
        "bytes is needed" in capsys.readouterr().err
    (tmp_path / "b.txt").write_bytes(b"efghi")
    assert main(["validate", str(_write(tmp_path, raw))]) == 0


def test_a_group_named_as_another_groups_device_is_refused() -> None:
    """A trace row names a group or a device: with groups `phones` (3) and `phones-1`, the
    phone `phones-1` could never be named, and its row would act on the group."""
    raw = minimal()
    raw["devices"][0]["count"] = 3
    raw["devices"].append({**raw["devices"][0], "group": "phones-1", "count": 2})
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    assert info.value.problems == [
        "devices: group 'phones-1' is named as a device of group 'phones' (its devices are "
        "phones-0 ...): a churn trace could not tell them apart; rename the group"]
    raw["devices"][1]["group"] = "phones-3"  # no such phone: phones has 0, 1 and 2
    assert parse_topology(raw).devices[-1].name == "phones-3-1"


@pytest.mark.parametrize("text", ["", "# a comment, nothing else\n", "---\n~\n"])
def test_an_empty_topology_file_says_it_is_empty(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    # it said "<top>: expected a mapping, got null"
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: 1 problem(s):\n  - the file holds nothing (empty, comments only or null); " \
        "a topology is a mapping with name:, devices: and job:" in err, err
    assert "<top>" not in err


def test_a_value_outside_a_closed_set_reads_expected_then_got(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # pydantic's "Input should be 'auto', 'loopback' or 'mininet' (got 'loopbak')" stood among
    # problems that all read "expected ..., got ..."
    raw = minimal()
    raw["network"] = {"backend": "loopbak"}
    raw["job"]["parallelism"] = {"strategy": "tensor"}
    assert main(["validate", str(_write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert "  - network.backend: expected 'auto', 'loopback' or 'mininet', got 'loopbak'\n" in err
    assert "  - job.parallelism.strategy: expected 'tile-tp', 'pipeline' or 'data-parallel', " \
        "got 'tensor'\n" in err, err
    assert "Input should be" not in err


@pytest.mark.parametrize("usable, backend", [(True, "mininet"), (False, "loopback")])
def test_validate_of_backend_auto_notes_what_up_would_refuse_on_this_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        usable: bool, backend: str) -> None:
    # network.ps.listen under backend auto validated "ok" and nothing more on a machine where
    # auto means Mininet, and `testbed up` then refused it; a pipeline likewise where it means
    # loopback
    from types import SimpleNamespace

    from testbed.emulator.network import probe

    monkeypatch.setattr(probe, "probe", lambda: SimpleNamespace(mininet_usable=usable))
    raw = minimal()
    if usable:
        raw["network"] = {"ps": {"listen": "127.0.0.1:0"}}
        refused = "network.ps.listen (devices on other machines) works with the loopback"
    else:
        raw["job"]["parallelism"] = {"strategy": "pipeline"}
        refused = "job.parallelism.strategy: pipeline runs on the Mininet backend only"
    path = _write(tmp_path, raw)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"note: {path}: network.backend auto is {backend} on this machine; testbed up " \
        f"would refuse it: {refused}" in out, out
    # a file no backend refuses is not probed for
    monkeypatch.setattr(probe, "probe", lambda: pytest.fail("probed"))
    assert main(["validate", str(_write(tmp_path, minimal()))]) == 0
    assert "note:" not in capsys.readouterr().out


def test_a_check_across_a_sections_keys_names_the_key_in_its_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "job: data.files: 1 file(s) hold 12 bytes ..." and "job: parallelism.micro_batches: ..."
    (tmp_path / "corpus.txt").write_text("hello world\n")
    raw = minimal()
    raw["job"].update(data={"files": ["corpus.txt"]}, batch_size=2,
                      parallelism={"strategy": "pipeline", "micro_batches": 4})
    assert main(["validate", str(_write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert "  - job.parallelism.micro_batches: 4 micro-batches need at least as many " \
        "sequences, batch_size is 2\n" in err, err
    assert "  - job.data.files: 1 file(s) hold 12 bytes together; a window of " \
        "model.seq_len + 1 = 9 bytes" not in err  # 12 bytes hold a window of 9: no problem
    raw["job"]["model"]["seq_len"] = 32
    raw["job"].update(batch_size=4)
    assert main(["validate", str(_write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert "  - job.data.files: 1 file(s) hold 12 bytes together; a window of " \
        "model.seq_len + 1 = 33 bytes is needed" in err, err
    assert "job: " not in err


def test_a_runs_resolved_topology_yaml_is_named_as_such(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `testbed validate RUN_DIR/topology.yaml` listed 15 problems ("groups: unknown key",
    # "network.ps.link.down_bps: unknown key", ...) and not what the file was
    resolved = load_topology(REPO / "topologies" / "default.yaml").to_yaml()
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: 1 problem(s):\n  - this is a run's resolved topology.yaml (testbed's own " \
        "keys: groups, down_bps, delay_s, ...), not a topology file; topology.input.yaml " \
        "beside it is the file the run was given" in err, err
