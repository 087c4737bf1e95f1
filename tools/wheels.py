"""Download the wheels ``make test NOVENV=1`` needs on a machine without network (``make wheels``).

The set is the closure of the given requirements as this interpreter resolved them (its installed
distributions, so the versions are the ones the suite ran with), less the torch/CUDA/triton stack and
the distributions ``--have`` names (already on the target machine). Each is downloaded as a binary
wheel for ``--python-version``; a distribution published only as an sdist (DeepSpeed) is built into a
wheel here (pure Python). Prints the pins and the folder's size.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
"""The accelerator stack: the target machine's own torch build brings it."""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> dict[str, str]:
    """name -> installed version for every distribution the requirements pull in (extras followed)."""
    out: dict[str, str] = {}
    todo = [(Requirement(r), ()) for r in requirements]
    while todo:
        req, _ = todo.pop()
        name = norm(req.name)
        extras = set(req.extras)
        key = name + "[" + ",".join(sorted(extras)) + "]"
        if key in out or STACK.match(name) or name == "ucp-dcp":
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # an optional dependency this platform does not install
        out[key] = dist.version
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((sub, ()))
    pins: dict[str, str] = {}
    for key, version in out.items():
        pins[key.split("[")[0]] = version
    return pins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requirements", required=True)
    ap.add_argument("--have", default="", help="distributions the target machine already has (space separated)")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--dest", default="wheels")
    a = ap.parse_args()
    reqs = [line.strip() for line in Path(a.requirements).read_text().splitlines() if line.strip()]
    have = {norm(n) for n in a.have.split()}
    pins = {n: v for n, v in closure(reqs).items() if n not in have}
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "pins.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    tag = a.python_version.replace(".", "")
    platform = [
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "any",
    ]
    built = []
    for name, version in sorted(pins.items()):
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            a.python_version,
            "--implementation",
            "cp",
            "--abi",
            f"cp{tag}",
            "--abi",
            "abi3",
            "--abi",
            "none",
            *platform,
            "-d",
            str(dest),
            f"{name}=={version}",
        ]
        if subprocess.run(cmd, capture_output=True).returncode != 0:  # sdist only: build a (pure Python) wheel
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), f"{name}=={version}"],
                check=True,
                env={**__import__("os").environ, "DS_BUILD_OPS": "0"},
            )
            built.append(name)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(
        f"wheels: {len(pins)} distributions for Python {a.python_version} in {dest}/ ({size / 2**20:.1f} MiB); "
        f"built from sdists: {built or 'none'}"
    )


if __name__ == "__main__":
    main()
