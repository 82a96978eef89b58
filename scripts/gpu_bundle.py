"""Build the folder of wheels a lent GPU machine needs to run ``scripts/gpu_check.py`` offline.

    python scripts/gpu_bundle.py                  # or: make gpu-bundle; writes .gpu-bundle/

The GPU machine (see docs/GPU.md) has Python 3.12, torch 2.11 (CUDA 13),
transformers 5.17, peft, numpy, rich, psutil and the rest of DeepSpeed's needs, but no DeepSpeed and no
network. The bundle holds what is missing: this package's wheel, a DeepSpeed 0.19.8 wheel built here from
its source distribution (pure Python: its CUDA ops compile just in time there), and DeepSpeed's needs the
machine lacks (hjson, pydantic and pydantic's own), as CPython 3.12 manylinux wheels, one version each. The
folder must stay under the 64 MiB that travels with the working tree; the script checks it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = "deepspeed==0.19.8"
MISSING = ["hjson==3.1.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
           "typing-inspection==0.4.5"]
"""DeepSpeed's requirements absent from the GPU machine's image, at versions that go together."""
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
LIMIT_BYTES = 64 * 2**20
RUN_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
               "/tmp/site .gpu-bundle/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && "
               "python3 scripts/gpu_check.py")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build(output: Path) -> list[Path]:
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(output), str(ROOT))
    with tempfile.TemporaryDirectory() as source:
        pip("download", "--quiet", "--no-deps", "--no-binary", ":all:", "--dest", source, DEEPSPEED)
        sdist = next(Path(source).glob("deepspeed-*.tar.gz"))
        # DeepSpeed's setup.py imports torch: build against this environment's (no ops are prebuilt)
        pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(output), str(sdist))
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
        "cp", *platforms, "--dest", str(output), *MISSING)
    return sorted(output.glob("*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--output", type=Path, default=ROOT / ".gpu-bundle", help="folder to (re)create")
    args = parser.parse_args()
    wheels = build(args.output)
    names = [wheel.name.split("-")[0].lower() for wheel in wheels]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        print(f"gpu_bundle: two versions of {duplicates} in {args.output}", file=sys.stderr)
        return 1
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:7.2f} MiB  in {args.output} (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        print("gpu_bundle: the bundle is over the limit that travels to the GPU machine", file=sys.stderr)
        return 1
    print(f"\non the GPU machine, from the repository root (carry {args.output.name}):\n  {RUN_COMMAND}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
