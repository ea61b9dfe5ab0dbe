"""Generated gRPC modules for proto/cpchat.proto (checked in; see `generate`), and `channel`, the one
module here written by hand."""

from __future__ import annotations

from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


def generate(out_root: Path) -> None:
    """Regenerate the stubs under out_root/cpchat/protocol (needs grpcio-tools)."""
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-Icpchat/protocol={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        "cpchat/protocol/cpchat.proto",
    ]
    (out_root / "cpchat" / "protocol").mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
