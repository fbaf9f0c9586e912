"""Pack vLLM (CUDA), Ray and the Python packages they need for a GPU machine that has no network.

For a CUDA machine whose image already holds torch (and the usual scientific stack) but not vLLM or
Ray, and that can only receive files through a size-limited copy (docs/benchmarks.md, "On a GPU",
used it with 64 MiB per call).  On this machine:

    python scripts/gpu_stage_offline.py --have have.txt --out .gpuw --part-mb 54

``have.txt`` lists the distributions the target already has, one name per line (``pip list`` there,
or the machine's documentation).  The script downloads wheels for the target (CPython 3.12,
manylinux x86-64) with ``pip download --no-deps``, follows each wheel's requirements itself
(skipping what the target has and the GPU kernel packages in ``SKIP``), drops the parts of vLLM and
Ray that a text-only rollout on Hopper never loads, packs everything as two xz tarballs and cuts
them into ``--part-mb`` pieces, one folder per piece (``.gpuw1``, ``.gpuw2``, ...).  On the target:
concatenate the pieces, unpack into one folder, put it on ``PYTHONPATH`` and set
``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer is left out).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Large GPU kernel packages vLLM imports lazily or only for features a rollout of a dense model does
# not use.
SKIP = [
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "flashinfer-cubin", "tilelang", "nvtx", "fastsafetensors", "quack-kernels", "tokenspeed-mla",
    "humming-kernels", "numba", "triton", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
    "opencv-python-headless", "ninja",
]
# xgrammar needs a newer tvm-ffi than the one vLLM 0.25 pins for FlashInfer (left out above).
PINS = {"apache-tvm-ffi": "apache-tvm-ffi==0.1.11"}
# Paths (relative to the unpacked site) that a text-only rollout on Hopper never loads.
DROP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2: vLLM uses FA3 on Hopper
    "vllm/_moe_C_stable_libtorch.abi3.so",  # mixture-of-experts kernels (optional import)
    "vllm/vllm-rs",
    "ray/jars",
    "ray/dashboard/client/build",
    "ray/rllib",
    "ray/tune",
    "ray/train",
    "ray/serve",
    "ray/llm",
    "bin",
]
PLATFORMS = [
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64",
]
MARKER_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
    "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
}


def wheel_of(wheels: str, name: str) -> str | None:
    for path in glob.glob(os.path.join(wheels, "*.whl")):
        if canonicalize_name(os.path.basename(path).split("-")[0]) == canonicalize_name(name):
            return path
    return None


def download(wheels: str, spec: str) -> None:
    plats = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", *plats, "-d", wheels, spec,
    ]
    # sdist only (antlr4, ...): build it
    if subprocess.run(cmd, capture_output=True, text=True).returncode:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, spec],
            check=True,
        )


def requirements(wheel: str, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(
                req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in extras or {""}
            ):
                out.append(req)
    return out


def resolve(roots: list[str], have: set[str], wheels: str) -> None:
    skip = {canonicalize_name(n) for n in SKIP}
    seen: set[tuple[str, frozenset[str]]] = set()
    queue = [Requirement(r) for r in roots]
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen or name in skip or name in have:
            continue
        seen.add(key)
        if wheel_of(wheels, name) is None:
            download(wheels, PINS.get(name, f"{req.name}{req.specifier}"))
        wheel = wheel_of(wheels, name)
        if wheel is None:
            raise SystemExit(f"no wheel for {req}")
        queue.extend(requirements(wheel, set(req.extras) | {""}))


def unpack(wheels: str, site: str) -> None:
    for wheel in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    # wheels' purelib/platlib trees go to the top level
    for data in glob.glob(os.path.join(site, "*.data")):
        for sub in ("purelib", "platlib"):
            if os.path.isdir(os.path.join(data, sub)):
                shutil.copytree(os.path.join(data, sub), site, dirs_exist_ok=True)
        shutil.rmtree(data)
    for rel in DROP:
        path = os.path.join(site, rel)
        shutil.rmtree(path) if os.path.isdir(path) else (os.path.exists(path) and os.remove(path))
    for root, dirs, files in os.walk(site):
        for d in [d for d in dirs if d == "__pycache__"]:
            shutil.rmtree(os.path.join(root, d))
        if "vllm/third_party" in root:  # vendored C++ headers and other Pythons' builds
            for f in files:
                if f.endswith((".hpp", ".h", ".cuh", ".cu", ".inl")) or (
                    "cpython-3" in f and "cpython-312" not in f
                ):
                    os.remove(os.path.join(root, f))
    # zip members keep their mode bits only in external_attr: put back the executables Ray starts
    for exe in glob.glob(os.path.join(site, "ray/core/src/ray/*/*")):
        if os.path.isfile(exe) and "." not in os.path.basename(exe):
            os.chmod(exe, 0o755)


def pack(site: str, out: str, part_bytes: int) -> list[str]:
    names = sorted(os.listdir(site))
    groups = {"vllm": [n for n in names if n == "vllm" or n.startswith("vllm-")]}
    groups["rest"] = [n for n in names if n not in groups["vllm"]]
    chunks = []
    for label, members in groups.items():
        archive = os.path.join(out, f"{label}.tar.xz")
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            for m in members:
                tar.add(os.path.join(site, m), arcname=m)
        with open(archive, "rb") as f:
            i = 0
            while block := f.read(part_bytes):
                chunks.append(f"{label}.tar.xz.part{i:02d}")
                with open(os.path.join(out, chunks[-1]), "wb") as g:
                    g.write(block)
                i += 1
        os.remove(archive)
    return chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--have", required=True, help="file: distributions the target already has, one per line"
    )
    ap.add_argument(
        "--out", default=".gpuw", help="prefix of the output folders (.gpuw1, .gpuw2, ...)"
    )
    ap.add_argument("--part-mb", type=float, default=54.0)
    ap.add_argument("--work", default="/tmp/gpu_stage")
    ap.add_argument(
        "roots",
        nargs="*",
        default=[
            "vllm==0.25.1", "ray==2.60.0", "omegaconf>=2.3", "hydra-core>=1.3", "tensordict>=0.8",
            "pydantic>=2", "fastapi>=0.110", "uvicorn>=0.29",
        ],
    )
    args = ap.parse_args()
    with open(args.have) as f:
        have = {canonicalize_name(line.strip()) for line in f if line.strip()}
    wheels, site, packed = (os.path.join(args.work, d) for d in ("wheels", "site", "packed"))
    for d in (wheels, site, packed):
        os.makedirs(d, exist_ok=True)
    resolve(args.roots, have, wheels)
    unpack(wheels, site)
    chunks = pack(site, packed, int(args.part_mb * 1e6))
    for i, chunk in enumerate(chunks, 1):
        folder = f"{args.out}{i}"
        os.makedirs(folder, exist_ok=True)
        shutil.move(os.path.join(packed, chunk), os.path.join(folder, chunk))
        print(folder, chunk, os.path.getsize(os.path.join(folder, chunk)))
    print(
        "on the target: cat each group's parts in order | python3 -c \"import sys, "
        "tarfile; tarfile.open("
        "fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')\"; export "
        "PYTHONPATH=/tmp/site "
        "VLLM_USE_FLASHINFER_SAMPLER=0"
    )


if __name__ == "__main__":
    main()
