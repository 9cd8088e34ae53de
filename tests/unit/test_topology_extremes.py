"""Topology files that used to pass `testbed validate` and then hang, crash or run something
other than what was written (found by fuzzing the CLI): each is now refused with its path."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from testbed import units
from testbed.agent.join import device_name_arg
from testbed.agent.tls import parse_address
from testbed.cli import main
from testbed.names import is_name
from testbed.perf_model.profiles import profile_name_problem
from testbed.schema import MAX_MESSAGE_CHARS
from testbed.topology import TopologyError, parse_topology
from testbed.user_paths import MAX_EXPANDED_VALUES, load_user_json, load_user_yaml


def minimal() -> dict:
    return {"name": "t", "devices": [{"group": "phones", "profile": "snapdragon888", "count": 2,
                                      "link": {"down": "100Mbit", "up": "20Mbit"}}],
            "job": {"model": {"hidden": 32, "layers": 1, "heads": 2, "ffn": 64, "seq_len": 8}}}


def validate(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    code = main(["validate", str(path)])
    return code, capsys.readouterr().err


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    text = yaml.safe_dump(minimal()) + "seed: 3\nseed: 9\n"
    code, err = validate(tmp_path, text, capsys)
    assert code == 2
    lines = text.splitlines()
    first, second = lines.index("seed: 3") + 1, lines.index("seed: 9") + 1
    assert f"line {second}" in err and f"first on line {first}" in err and "'seed'" in err


def test_merge_keys_are_not_duplicates() -> None:
    doc = load_user_yaml("base: &b {down: 1Gbit, up: 1Gbit}\nlink:\n  <<: *b\n  up: 2Gbit\n")
    assert doc["link"] == {"down": "1Gbit", "up": "2Gbit"}


def test_aliases_that_expand_a_small_file_beyond_every_real_one_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """884 bytes of aliases, eight levels of ten, are 10^8 values: validate ran 9.7 s and printed
    322 MB quoting them. Now the loader refuses them, and within the limit a problem's line stays
    short however large the value it quotes."""
    levels = "abcdefgh"
    text = "name: x\n" + "".join(
        f"{name}: &{name} [{', '.join([f'*{levels[i - 1]}' if i else '1'] * 10)}]\n"
        for i, name in enumerate(levels)) + "churn: *h\n"
    assert len(text) < 1000
    code, err = validate(tmp_path, text, capsys)
    assert code == 2 and f"more than {MAX_EXPANDED_VALUES:,} values" in err, err[:500]
    assert len(err) < 1000
    # self-reference is one value, not a loop
    assert load_user_yaml("a: &a [*a]\n")["a"][0][0] is not None
    # within the limit (10^4 values): each problem one short line
    text = "name: x\n" + "".join(
        f"{name}: &{name} [{', '.join([f'*{levels[i - 1]}' if i else '1'] * 10)}]\n"
        for i, name in enumerate(levels[:4])) + "churn: *d\ntime_dilation: *d\n"
    code, err = validate(tmp_path, text, capsys)
    assert code == 2 and "churn" in err and "time_dilation" in err
    assert max(len(line) for line in err.splitlines()) <= MAX_MESSAGE_CHARS + 40, err[:2000]


def test_a_path_that_names_a_directory_or_a_fifo_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`churn: /tmp` said "no such file: /tmp"."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    base = (Path(__file__).parents[1] / "data" / "tiny.yaml").read_text()
    for value, said in ((str(tmp_path), "is a directory; expected a file"),
                        (str(fifo), "is not a regular file"),
                        (str(tmp_path / "none.csv"), "no such file")):
        code, err = validate(tmp_path, base + f"churn: {value}\n", capsys)
        assert code == 2 and "churn: " in err and said in err and value in err, err
    code, err = validate(tmp_path, base.replace("profile: snapdragon888",
                                                f"profile: {tmp_path}", 1), capsys)
    assert code == 2 and "is a directory; expected a file" in err and "profile" in err, err


def test_deep_nesting_is_refused_not_a_recursion_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = validate(tmp_path, "name: x\nseed: " + "[" * 600 + "]" * 600 + "\n", capsys)
    assert code == 2 and "nested more than" in err and "line 2" in err


def test_json_the_decoder_cannot_take_is_a_decode_error() -> None:
    import json
    for text in ("[" * 100_000 + "]" * 100_000, "1" + "0" * 5000):
        with pytest.raises(json.JSONDecodeError):
            load_user_json(text)
    assert load_user_json('{"a": [1, 2.5]}') == {"a": [1, 2.5]}


@pytest.mark.parametrize("rate", ["1e-15bit", "999bit", "0.1Kbit"])
def test_a_rate_below_1kbit_is_refused(rate: str) -> None:
    with pytest.raises(units.UnitError, match="at least 1kbit"):
        units.parse_rate_bps(rate)
    assert units.parse_rate_bps("1kbit") == 1e3
    raw = minimal()
    raw["devices"][0]["link"]["down"] = rate
    with pytest.raises(TopologyError, match=r"devices\[0\]\.link\.down: a rate must be at least"):
        parse_topology(raw)


def test_a_link_that_loses_every_packet_is_refused() -> None:
    raw = minimal()
    raw["devices"][0]["link"]["loss"] = "100%"
    with pytest.raises(TopologyError, match=r"devices\[0\]\.link\.loss: .* below 100%"):
        parse_topology(raw)
    raw["devices"][0]["link"]["loss"] = "99.9%"
    assert parse_topology(raw).devices[0].link.loss_fraction == pytest.approx(0.999)


def test_a_port_of_non_ascii_digits_is_refused() -> None:
    raw = minimal()
    raw["network"] = {"ps": {"listen": "0.0.0.0:\uff15\uff10\uff10"}}
    with pytest.raises(TopologyError, match=r"network\.ps\.listen: expected HOST:PORT"):
        parse_topology(raw)


@pytest.mark.parametrize("listen, why", [
    ("ps.example.org:50051", "a name; a PS listens on an IP address"),
    ("::1:50051", "write an IPv6 address in brackets"),
    ("[10.0.0.1]:50051", "in brackets is not an IPv6 address"),
    ("0.0.0.0:65536", "a whole number 0-65535"),
    ("0.0.0.0", "no port"),
])
def test_a_listen_address_is_parsed_as_every_address_is(listen: str, why: str) -> None:
    raw = minimal()
    raw["network"] = {"ps": {"listen": listen}}
    with pytest.raises(TopologyError, match=r"network\.ps\.listen: expected HOST:PORT") as caught:
        parse_topology(raw)
    assert why in str(caught.value)


@pytest.mark.parametrize("listen, host, port", [
    ("0.0.0.0:0", "0.0.0.0", 0), ("[::]:50051", "::", 50051), ("192.168.1.10:7", "192.168.1.10", 7),
])
def test_a_listen_address_of_this_host_is_kept(listen: str, host: str, port: int) -> None:
    raw = minimal()
    raw["network"] = {"ps": {"listen": listen}}
    assert parse_topology(raw).network.ps.listen == listen
    assert parse_address(listen, listen=True) == (host, port)


def test_one_name_rule_serves_topologies_profiles_and_joins() -> None:
    """The whole string must follow the rule: a final newline is not let through."""
    for good in ("phones", "a", "sd-888", "x" * 24):
        assert is_name(good) and profile_name_problem(good) is None
        assert device_name_arg(good) == good
    for bad in ("phones\n", "Phones", "-a", "x" * 25, "", "a b", "a/b"):
        assert not is_name(bad)
        assert "not a valid profile name" in (profile_name_problem(bad) or "")
        with pytest.raises(argparse.ArgumentTypeError, match="lower-case letters"):
            device_name_arg(bad)


def test_switches_without_links_have_no_path_to_the_ps() -> None:
    raw = minimal()
    raw["network"] = {"switches": ["ap0", "s1"], "ps": {"switch": "ap0"}}
    raw["devices"][0]["switch"] = "s1"
    with pytest.raises(TopologyError, match="switch 's1' has no path to the PS's switch 'ap0'"):
        parse_topology(raw)
    raw["network"]["links"] = [{"switches": ["ap0", "s1"], "down": "1Gbit", "up": "1Gbit"}]
    assert parse_topology(raw).devices[0].group.switch == "s1"


def test_validate_reads_the_churn_trace_as_a_run_would(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    raw = minimal()
    raw["churn"] = str(trace)
    trace.write_text("time_s,device,event,arg\n1,phones-0,leave,\n")
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 0, err
    trace.write_text("time_s,device,event,arg\n1,tablets-0,leave,\n")
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 2 and "line 2" in err and "tablets-0" in err and str(trace) in err


def test_a_trace_under_which_no_device_is_ever_present_is_refused_before_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "gone.csv"
    trace.write_text("time_s,device,event,arg\n0,phones,leave,\n")
    raw = minimal()
    raw["churn"] = str(trace)
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 2 and "no device is ever present" in err and str(trace) in err
    # cut off at 0 and never healed: a simulation ran 5 virtual seconds to a stall, exit 1;
    # healed or joined at some time, a device is reachable then
    for rows, refused in (("0,phones,partition,\n", True),
                          ("0,phones-0,leave,\n0,phones-1,partition,\n", True),
                          ("0,phones,partition,\n9,phones-1,heal,\n", False),
                          ("0,phones,leave,\n4,phones-0,join,\n", False),
                          ("0.001,phones,partition,\n", False)):
        trace.write_text("time_s,device,event,arg\n" + rows)
        code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
        assert (code == 2 and "no device is ever present and reachable" in err) == refused, \
            (rows, err)
    trace.write_text("time_s,device,event,arg\n0,phones,leave,\n")
    out = tmp_path / "runs"
    assert main(["simulate", str(tmp_path / "topo.yaml"), "--out", str(out)]) == 2
    assert not out.exists()
    trace.write_text("time_s,device,event,arg\n0,phones,leave,\n2,phones-1,join,\n")
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 0, err


def test_a_weight_decay_above_1_is_refused() -> None:
    raw = minimal()
    raw["job"]["optimizer"] = {"weight_decay": 1e300}
    with pytest.raises(TopologyError, match=r"job\.optimizer\.weight_decay: must be <= 1"):
        parse_topology(raw)
    raw["job"]["optimizer"] = {"weight_decay": 0.1}
    assert parse_topology(raw).job.optimizer.weight_decay == 0.1


def test_a_key_that_is_not_a_string_names_its_mapping(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = validate(tmp_path, "name: x\ndevices:\n  - {group: a, 3: b}\n", capsys)
    assert code == 2 and "devices[0]: key 3: expected a str key, got int" in err


def test_a_tile_that_cuts_a_gemm_into_too_many_tiles_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tile: 1` on a 4,096-token job (planner fifo) made 12.6 million tiles of one GEMM and
    5.5 GB in a minute before its first step. GEMMs the PS keeps (below min_offload_flops) are
    not cut, so do not count."""
    from testbed.topology import MAX_GEMM_TILES

    raw = minimal()
    raw["job"]["model"].update(hidden=256, ffn=1024, seq_len=512)
    raw["job"]["batch_size"] = 8  # 4,096 tokens: fc1 has 4,096 x 1,024 results
    raw["job"]["parallelism"] = {"tile": 4, "planner": "fifo"}
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 2 and MAX_GEMM_TILES < 262_144, err
    assert ("job.parallelism.tile: [4, 4] cuts layers.0.fc1 (forward, 4,096 x 1,024 results) "
            "into 262,144 tiles; expected at most 100,000 a GEMM (a larger tile)") in err, err
    raw["job"]["parallelism"]["tile"] = 8  # the largest GEMM now: 65,536 tiles
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 0, err
    raw["job"]["parallelism"].update(tile=1, min_offload_flops=1e15)  # nothing offloaded
    code, err = validate(tmp_path, yaml.safe_dump(raw), capsys)
    assert code == 0, err


def test_an_address_with_a_port_of_thousands_of_digits_says_what_was_expected() -> None:
    """int() of 5,000 digits raised Python's own 'Exceeds the limit (4300 digits)' message."""
    with pytest.raises(ValueError) as raised:
        parse_address("127.0.0.1:" + "9" * 5000)
    assert "the port must be a whole number 1-65535" in str(raised.value)
    assert len(str(raised.value)) < 400 and "4300" not in str(raised.value)
