"""Generate the Python API from proto/ into cosystream/v1/ with the pinned grpcio-tools.

python scripts/gen_protos.py           # regenerate
python scripts/gen_protos.py --check   # fail if the committed code differs from what would be generated
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = ["cosystream/v1/cosystream.proto"]
GENERATED = ["cosystream_pb2.py", "cosystream_pb2.pyi", "cosystream_pb2_grpc.py"]
PACKAGE_DIR = Path("cosystream/v1")
PINNED_TOOLS = "1.85.1"


def generate(out_dir: Path) -> None:
    import grpc_tools

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if version != PINNED_TOOLS:
        sys.exit(f"grpcio-tools {version} found; the generated code is pinned to {PINNED_TOOLS}")
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / p) for p in PROTOS),
    ]
    subprocess.run(command, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / PACKAGE_DIR
        if args.check:
            stale = [
                name
                for name in GENERATED
                if not filecmp.cmp(fresh / name, ROOT / PACKAGE_DIR / name, shallow=False)
            ]
            if stale:
                print(f"generated code is out of date: {', '.join(stale)}; run: python scripts/gen_protos.py")
                return 1
            print("generated code is up to date")
            return 0
        for name in GENERATED:
            shutil.copyfile(fresh / name, ROOT / PACKAGE_DIR / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
