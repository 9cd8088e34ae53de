"""Regenerate the committed gRPC stubs from testbed.proto (``make protos``).

The stubs are generated with the repository root as the proto path, so that they import each
other as ``testbed.wire.testbed_pb2``. ``generate(out_dir)`` writes into another
directory so that the freshness test can compare without touching the tree.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parents[1]
PROTO = PROTO_DIR / "testbed.proto"
GENERATED = ("testbed_pb2.py", "testbed_pb2.pyi", "testbed_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc into out_root (mirroring the package path); return the generated files."""
    from grpc_tools import protoc  # build-time only: agents on phones do not need grpcio-tools

    rel = PROTO.relative_to(REPO_ROOT)  # outputs mirror the package path under out_root
    args = ["protoc", f"-I{REPO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_root / rel.parent / name for name in GENERATED]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (PROTO_DIR / path.name).write_bytes(path.read_bytes())
            print(f"wrote {PROTO_DIR / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
