"""Regenerate the committed gRPC stubs in steerspec/v1/ from proto/steerspec/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]   (DIR defaults to the repository root)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    """Run protoc for every .proto under proto/steerspec/v1; return the generated files."""
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "steerspec" / "v1").glob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    gen_dir = out / "steerspec" / "v1"
    (gen_dir / "__init__.py").write_text('"""Generated gRPC stubs for package steerspec.v1 (see scripts/gen_protos.py)."""\n')
    return sorted(gen_dir.glob("*_pb2*.py*")) + [gen_dir / "__init__.py"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
