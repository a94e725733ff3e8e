"""Regenerates ``link_pb2.py`` and ``link_pb2_grpc.py`` from ``link.proto`` with grpcio-tools.

The generated modules are checked in, so running a job needs only grpcio and protobuf;
``tests/unit/test_link_proto.py`` regenerates them and fails when they are not current.
Run ``python -m islands.link.codegen`` after editing ``link.proto`` (needs the dev extra).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = "link.proto"
OUTPUTS = ("link_pb2.py", "link_pb2_grpc.py")


def generate(out_dir: str) -> dict[str, str]:
    """Generates the modules into ``out_dir``; returns {file name: text}.

    The proto is compiled as ``islands/link/link.proto`` so the generated code imports
    ``islands.link.link_pb2`` (the installed package path).

    Raises:
      RuntimeError: protoc failed (its exit status is in the message).
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "islands", "link")
        os.makedirs(src)
        shutil.copy(os.path.join(HERE, PROTO), os.path.join(src, PROTO))
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", os.path.join("islands", "link", PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc} on {PROTO}")
        texts = {}
        for name in OUTPUTS:
            with open(os.path.join(src, name)) as f:
                texts[name] = f.read()
    os.makedirs(out_dir, exist_ok=True)
    for name, text in texts.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    return texts


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else HERE)
    print(f"wrote {', '.join(OUTPUTS)} into {sys.argv[1] if len(sys.argv) > 1 else HERE}")
