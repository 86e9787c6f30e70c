"""Python modules for the control plane, generated from the .proto files.

This is how an outside client (one nobody here wrote) talks to the
coordinator: it needs nothing but proto/zerod/v1/{ipc,control}.proto and
proto/grpc/health/v1/health.proto, compiled with the stock protoc and gRPC
Python plugin (Debian: protobuf-compiler, protobuf-compiler-grpc,
python3-grpcio, python3-protobuf).

    from ctlproto import load
    pb = load()
    stub = pb.control_grpc.ClusterStub(channel)
    stub.Join(pb.control.JoinRequest(node=pb.control.NodeInfo(...)))

load() generates the modules into a temporary directory once per process
and returns them as attributes: ipc, control, control_grpc, health,
health_grpc.
"""

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTOS = ["zerod/v1/ipc.proto", "zerod/v1/control.proto", "grpc/health/v1/health.proto"]
GRPC_PLUGIN = os.environ.get("ZEROD_GRPC_PYTHON_PLUGIN", "/usr/bin/grpc_python_plugin")

_cache = None


def _protoc(args):
    protoc = shutil.which("protoc")
    if protoc is None:
        raise RuntimeError("protoc not found (Debian package protobuf-compiler)")
    proc = subprocess.run([protoc, "--proto_path=" + PROTO_DIR] + args,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError("protoc %s failed:\n%s" % (" ".join(args), proc.stderr))


def load():
    """Generates (once per process) and imports the control plane modules."""
    global _cache
    if _cache is not None:
        return _cache
    if not os.path.exists(GRPC_PLUGIN):
        raise RuntimeError("%s not found (Debian package protobuf-compiler-grpc)" % GRPC_PLUGIN)
    out = tempfile.mkdtemp(prefix="zerod-ctlproto-")
    _protoc(["--python_out=" + out] + PROTOS)
    _protoc(["--grpc_python_out=" + out,
             "--plugin=protoc-gen-grpc_python=" + GRPC_PLUGIN,
             "zerod/v1/control.proto", "grpc/health/v1/health.proto"])
    # The generated modules import each other as packages named after the
    # proto directories (zerod.v1.ipc_pb2, grpc.health.v1.health_pb2). Both
    # names are taken in a test process (grpc is grpcio, zerod the client
    # library), so the modules are moved under private top-level names and
    # their imports rewritten to match.
    renames = {
        "zerod/v1/ipc_pb2.py": "zerod_ctl_ipc_pb2.py",
        "zerod/v1/control_pb2.py": "zerod_ctl_control_pb2.py",
        "zerod/v1/control_pb2_grpc.py": "zerod_ctl_control_pb2_grpc.py",
        "grpc/health/v1/health_pb2.py": "zerod_ctl_health_pb2.py",
        "grpc/health/v1/health_pb2_grpc.py": "zerod_ctl_health_pb2_grpc.py",
    }
    imports = {
        "from zerod.v1 import ipc_pb2 as": "import zerod_ctl_ipc_pb2 as",
        "from zerod.v1 import control_pb2 as": "import zerod_ctl_control_pb2 as",
        "from grpc.health.v1 import health_pb2 as": "import zerod_ctl_health_pb2 as",
    }
    for old, new in renames.items():
        with open(os.path.join(out, old)) as f:
            text = f.read()
        for statement, replacement in imports.items():
            text = text.replace(statement, replacement)
        with open(os.path.join(out, new), "w") as f:
            f.write(text)
    shutil.rmtree(os.path.join(out, "zerod"))
    shutil.rmtree(os.path.join(out, "grpc"))
    sys.path.insert(0, out)
    try:
        ipc = importlib.import_module("zerod_ctl_ipc_pb2")
        control = importlib.import_module("zerod_ctl_control_pb2")
        control_grpc = importlib.import_module("zerod_ctl_control_pb2_grpc")
        health = importlib.import_module("zerod_ctl_health_pb2")
        health_grpc = importlib.import_module("zerod_ctl_health_pb2_grpc")
    finally:
        sys.path.remove(out)
    _cache = types.SimpleNamespace(ipc=ipc, control=control, control_grpc=control_grpc,
                                   health=health, health_grpc=health_grpc, dir=out)
    return _cache

