"""The checked-in gRPC modules must match proto/."""

from pathlib import Path

import cpchat.protocol as protocol

GENERATED = ("cpchat_pb2.py", "cpchat_pb2_grpc.py", "cpchat_pb2.pyi")


def test_generated_modules_are_fresh(tmp_path):
    protocol.generate(tmp_path)
    here = Path(protocol.__file__).parent
    for name in GENERATED:
        fresh = (tmp_path / "cpchat" / "protocol" / name).read_text()
        assert fresh == (here / name).read_text(), (
            f"{name} is stale: regenerate with cpchat.protocol.generate"
        )
