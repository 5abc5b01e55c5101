"""Generate the protobuf/gRPC stubs (``kvsvc/v1``) from ``protos/``, or check they match.

The stubs are committed (one copy, importable as ``kvsvc.v1``) so that installing the
server needs no code generator; ``--check`` regenerates into a scratch directory and fails
when the committed copy has drifted from the ``.proto`` files.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
OUT_PACKAGE = Path("kvsvc") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto into ``out_root``; return the generated files."""
    from grpc_tools import protoc  # dev extra only

    protos = sorted((PROTO_ROOT / "kvsvc" / "v1").glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    # protoc resolves the relative proto paths against -I roots; run from the proto root.
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit status {code}")
    out_dir = out_root / OUT_PACKAGE
    (out_dir / "__init__.py").write_text(
        '"""Generated protobuf/gRPC stubs for package kvsvc.v1. Do not edit: run `make proto`."""\n'
    )
    return sorted(out_dir.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs drifted")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        committed_dir = REPO_ROOT / OUT_PACKAGE
        if args.check:
            drifted = [
                p.name
                for p in generated
                if p.is_file()
                and (
                    not (committed_dir / p.name).exists()
                    or not filecmp.cmp(p, committed_dir / p.name, shallow=False)
                )
            ]
            stale = sorted(
                {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in generated}
            )
            if drifted or stale:
                print(
                    "protobuf stubs drifted from protos/ (run `make proto`): "
                    + ", ".join(drifted + stale),
                    file=sys.stderr,
                )
                return 1
            print("protobuf stubs match protos/")
            return 0
        for old in committed_dir.glob("*_pb2*.py*"):
            old.unlink()
        committed_dir.mkdir(parents=True, exist_ok=True)
        for p in generated:
            if p.is_file():
                shutil.copy2(p, committed_dir / p.name)
        print(f"generated {len(generated)} files into {OUT_PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
