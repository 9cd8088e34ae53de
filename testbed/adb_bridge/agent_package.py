"""The agent as one zip that a phone's Python runs directly (``python agent.zip ARGS``).

Contents: every ``.py`` under ``testbed/agent/``, the generated protocol modules
(``testbed/wire/*_pb2*.py``), every ``testbed.*`` module those import (found by
reading their ``import`` statements with :mod:`ast`, transitively; imports under
``if TYPE_CHECKING:`` do not count), the ``__init__.py`` of every package on the way, and a
top-level ``__main__.py`` that runs ``testbed.agent`` as ``python -m testbed.agent`` would. The
phone has numpy and grpcio, not torch: a module in that closure that imports torch is an error
here, not a crash on the phone.
"""

from __future__ import annotations

import ast
import io
import zipfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds testbed/
PHONE_DIR = "/data/local/tmp/testbed"  # where the bridge puts the agent on the phone
START_SCRIPT = Path(__file__).resolve().parent / "phone" / "start-agent.sh"
PHONE_FORBIDDEN = ("torch",)  # packages the phone does not have
_MAIN = (b"import runpy\n"
         b"runpy.run_module('testbed.agent', run_name='__main__', alter_sys=True)\n")
_FIXED_TIME = (2024, 1, 1, 0, 0, 0)  # same bytes for the same sources: the push can be skipped


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    """Dotted module name of a file under root, and whether it is a package's __init__."""
    rel = path.relative_to(root).with_suffix("")
    is_package = rel.name == "__init__"
    return ".".join(rel.parts[:-1] if is_package else rel.parts), is_package


def _imports(root: Path, path: Path) -> set[str]:
    """Absolute module names a file imports at run time (not under ``if TYPE_CHECKING``)."""
    module, is_package = _module_name(root, path)
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                names.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names.add(base)
                names.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def _module_file(root: Path, name: str) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def agent_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The source files that go into the zip, relative to root (which holds ``testbed/``)."""
    agent_dir = root / "testbed" / "agent"
    todo = sorted(agent_dir.rglob("*.py"))
    if not todo:
        raise FileNotFoundError(f"no agent sources under {agent_dir}")
    todo += sorted((root / "testbed" / "wire").glob("*_pb2*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen or "__pycache__" in path.parts:
            continue
        seen.add(path)
        rel = path.relative_to(root)
        for parent in rel.parents:  # every package on the way needs its __init__.py
            init = root / parent / "__init__.py"
            if parent.parts and init.is_file():
                todo.append(init)
        for name in _imports(root, path):
            top = name.split(".")[0]
            if top in PHONE_FORBIDDEN:
                raise ValueError(f"{rel} imports {name}, which phones do not have; the agent "
                                 f"must need only numpy and grpcio")
            if top == "testbed":
                found = _module_file(root, name)
                if found is not None:
                    todo.append(found)
    return sorted(p.relative_to(root) for p in seen)


def build_agent_zip(root: Path = PACKAGE_ROOT) -> bytes:
    """The agent zip's bytes (deterministic for the same sources)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel in agent_files(root):
            info = zipfile.ZipInfo(rel.as_posix(), _FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, (root / rel).read_bytes())
        info = zipfile.ZipInfo("__main__.py", _FIXED_TIME)
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, _MAIN)
    return buffer.getvalue()
