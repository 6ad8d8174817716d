"""The committed generated code is exactly what scripts/gen_protos.sh makes now."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        [str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.name for p in (tmp_path / "seedrl" / "proto").iterdir())
    committed = sorted(
        p.name for p in (ROOT / "seedrl" / "proto").iterdir() if p.name.startswith("seedrl_pb2")
    )
    assert generated == committed
    for name in generated:
        fresh = (tmp_path / "seedrl" / "proto" / name).read_text()
        assert fresh == (ROOT / "seedrl" / "proto" / name).read_text(), (
            f"seedrl/proto/{name} is stale: run scripts/gen_protos.sh and commit the result"
        )


def test_grpc_and_protobuf_versions_match_the_generated_code():
    import grpc
    import grpc_tools

    from seedrl.proto import seedrl_pb2_grpc

    assert grpc.__version__ == seedrl_pb2_grpc.GRPC_GENERATED_VERSION
    # grpcio-tools is pinned to the same release as grpcio.
    from importlib.metadata import version

    assert version("grpcio-tools") == grpc.__version__
    assert grpc_tools is not None
