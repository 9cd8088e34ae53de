"""The command lines the README, docs/ and docstrings show still name what the code has: every
`testbed` sub-command and flag, every bench script and its flags, every file of the repository.

Docs drift when a flag is renamed or a script moved; a reader then gets "unrecognized
arguments" from a line copied out of the docs. This reads the lines as a reader would (code
blocks and inline code, usage syntax such as ``[--steps N]`` included) and checks them against
the real parsers (``testbed.cli.build_parser``) and files.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import Iterator

from testbed.cli import build_parser
from tests.conftest import REPO

# the README, docs/, and the docstrings of the bench scripts (they say how to run them) and of
# testbed's modules
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "bench").glob("*.py")), *sorted((REPO / "testbed").rglob("*.py"))]
PLACEHOLDER = re.compile(r"[A-Z][A-Z_0-9]*(\.[a-z]+)?")  # NAME.py, RUN_DIR, COPY: not a file
REPO_PATH = re.compile(r"(?:topologies|tests|testbed|bench|traces)/[A-Za-z0-9_./-]+"
                       r"\.(?:yaml|py|csv|md)")


def code_spans(path: Path) -> Iterator[str]:
    """Each line of a fenced block and each inline code span (joined if it wraps), comments
    after `` #`` cut; of a Python file, its docstring's."""
    text = path.read_text()
    if path.suffix == ".py":
        text = ast.get_docstring(ast.parse(text)) or ""
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        yield from (line.split(" #")[0].strip() for line in block.splitlines())
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        yield " ".join(span.split()).split(" #")[0]


def words(text: str) -> list[str]:
    """A command line's words, usage syntax (``[--a N | --b]``) read as the words in it."""
    return re.sub(r"[\[\]|]", " ", text).split()


def flags(tokens: list[str]) -> list[str]:
    """The option names among tokens (``--out=DIR`` -> ``--out``; negative numbers are not)."""
    return [t.split("=")[0].rstrip(",.)") for t in tokens
            if t.startswith("-") and len(t) > 1 and not re.fullmatch(r"-[0-9.]+", t)]


def sub_commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_problems(span: str, root: argparse.ArgumentParser) -> list[str]:
    """What a span's `testbed ...` command names that the parser does not have."""
    out = []
    for match in re.finditer(r"(?:^|[\s/])testbed\s+([a-z][^;&]*)", span):
        tokens = words(match.group(1))
        parser, path = root, ["testbed"]
        while tokens and tokens[0] in sub_commands(parser):
            parser = sub_commands(parser)[tokens[0]]
            path.append(tokens.pop(0))
        if len(path) == 1:
            continue  # prose ("testbed is ..."), not a command
        out += [f"`{' '.join(path)}` has no {flag}" for flag in flags(tokens)
                if flag not in parser._option_string_actions]
    return out


def bench_problems(span: str) -> list[str]:
    """Bench scripts a span runs that do not exist, or lack a flag it passes them."""
    out = []
    for match in re.finditer(r"bench/([a-z_]+\.py)((?:\s+[^\s`]+)*)", span):
        script = REPO / "bench" / match.group(1)
        if not script.exists():
            out.append(f"bench/{match.group(1)} does not exist")
            continue
        source = script.read_text()
        out += [f"bench/{match.group(1)} has no {flag}" for flag in flags(words(match.group(2)))
                if f'"{flag}"' not in source]
    return out


def path_problems(span: str) -> list[str]:
    return [f"{path} does not exist" for path in REPO_PATH.findall(span)
            if not PLACEHOLDER.fullmatch(Path(path).name) and not (REPO / path).exists()]


def test_every_command_line_in_the_docs_names_what_the_code_has() -> None:
    root = build_parser()
    problems = [f"{doc.relative_to(REPO)}: `{span}`: {problem}"
                for doc in DOCS for span in code_spans(doc)
                for problem in command_problems(span, root) + bench_problems(span)
                + path_problems(span)]
    assert not problems, "\n".join(problems)
    # and it read them: the docs show well over a hundred testbed command lines
    commands = sum(bool(re.search(r"(?:^|[\s/])testbed\s+[a-z]", span))
                   for doc in DOCS for span in code_spans(doc))
    assert commands > 100, commands


def test_the_check_finds_what_it_looks_for() -> None:
    root = build_parser()
    assert command_problems(".venv/bin/testbed simulate t.yaml --steps 1 --no-such", root) == \
        ["`testbed simulate` has no --no-such"]
    assert command_problems("testbed net check T [--per-group N | --devices NAME ...]", root) \
        == []
    assert command_problems("testbed perf fit A --frobnicate=3", root) == \
        ["`testbed perf fit` has no --frobnicate"]
    assert bench_problems("bench/stage_profile.py topologies/large.yaml --stages --nope") == \
        ["bench/stage_profile.py has no --nope"]
    assert bench_problems("bench/no_such_bench.py") == ["bench/no_such_bench.py does not exist"]
    assert path_problems("topologies/nowhere.yaml and bench/NAME.py") == \
        ["topologies/nowhere.yaml does not exist"]
