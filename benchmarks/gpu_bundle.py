"""The GPU bundle: the wheels a bare GPU image lacks, built here and installed there without a package index.

The GPU image (benchmarks/gpu_check.sh's target) has Python 3.12, torch 2.11 (CUDA), triton, transformers and
what they pull in (safetensors, huggingface_hub, filelock, pyyaml, tokenizers, regex, requests, tqdm, packaging),
numpy, pandas, pytest and sympy. fp8rl's GPU check also needs megatron-core (the trainer's model), torchao (the
FP8 training GEMMs) and math-verify with its parsers (imported by the task registry): `BUNDLE_PINS`, the same
pins as pyproject.toml. ``build`` downloads exactly those wheels for the image's Python, writes ``manifest.json``
(name, version, bytes, sha256 of each wheel) and refuses a bundle over `MAX_BUNDLE_BYTES` or one whose
dependency closure reaches a package that is neither bundled nor in `IMAGE_PACKAGES`. ``install`` checks the
hashes and the wheels' tags against the running interpreter and installs them offline (``pip install --no-index
--no-deps --target``, or by unpacking the wheels where pip is absent) into a folder for PYTHONPATH (in the
temp dir, outside the bundle).

No warm-start cache is bundled: the tiny runs' warm start is shipped in fp8rl/assets/warmstart (13.8 MB, tracked),
so it travels with the working tree; ``build`` reports its size and the working tree's against the carry limit.

    python benchmarks/gpu_bundle.py build [--python-version 3.12] [--out .gpu-bundle]
    python benchmarks/gpu_bundle.py install [--bundle .gpu-bundle] [--target DIR]   # prints DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> version: megatron-core, torchao and math-verify as pinned in pyproject.toml (tests/benchmarks checks the
# pins agree), and math-verify's own pins. antlr4-python3-runtime 4.13.2: latex2sympy2_extended 1.11.0 accepts
# 4.9.3-4.13.2 and ships a parser for each; 4.9.3 (what the dev venv has, via omegaconf) is a source-only release,
# 4.13.2 has a wheel.
BUNDLE_PINS = {
    "megatron-core": "0.16.1",
    "torchao": "0.18.0",
    "math-verify": "0.9.0",
    "latex2sympy2_extended": "1.11.0",
    "antlr4-python3-runtime": "4.13.2",
}
# What the GPU image has (the bundle's closure may end there): torch and its own dependencies, transformers and its.
IMAGE_PACKAGES = frozenset(
    {
        "torch",
        "triton",
        "typing-extensions",
        "sympy",
        "mpmath",
        "networkx",
        "jinja2",
        "fsspec",
        "filelock",
        "setuptools",
        "transformers",
        "safetensors",
        "huggingface-hub",
        "pyyaml",
        "tokenizers",
        "regex",
        "requests",
        "tqdm",
        "packaging",
        "numpy",
        "pandas",
        "pytest",
    }
)
MAX_BUNDLE_BYTES = 40 * 2**20  # the limit for what is carried besides the tree
CARRY_LIMIT_BYTES = 64 * 2**20  # working tree + carried folders, as the device machine copies them
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
WARMSTART_DIR = "fp8rl/assets/warmstart"


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def abi_tag(python_version: str) -> str:
    major, minor = python_version.split(".")[:2]
    return f"cp{major}{minor}"


def download_command(python_version: str, dest: Path) -> list[str]:
    """pip download of `BUNDLE_PINS` as binary wheels for CPython `python_version` on x86-64 Linux (no deps: the
    closure is checked from the wheels' metadata instead, against what the image has)."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:", "--no-deps"]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    cmd += ["--abi", abi_tag(python_version), "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    cmd += ["--dest", str(dest)]
    return cmd + [f"{name}=={version}" for name, version in BUNDLE_PINS.items()]


def wheel_metadata(wheel: Path) -> dict:
    """(Name, Version, Requires-Dist) of a wheel, from its METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = Parser().parsestr(zf.read(meta_name).decode())
    return {"name": message["Name"], "version": message["Version"], "requires": message.get_all("Requires-Dist") or []}


def unmet_requirements(wheels: list[dict], python_version: str) -> list[str]:
    """Requirements of the bundled wheels (their markers evaluated for the target Python, extras left out) that
    neither the bundle nor the image provides."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": python_version, "python_full_version": python_version + ".0"}
    env.update({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""})
    provided = {normalize(w["name"]) for w in wheels} | IMAGE_PACKAGES
    missing = []
    for wheel in wheels:
        for line in wheel["requires"]:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if normalize(req.name) not in provided:
                missing.append(f"{wheel['name']} {wheel['version']} requires {line}")
    return missing


def tree_bytes(root: Path = ROOT) -> int | None:
    """Bytes of what the device machine copies of the working tree: tracked files and untracked, unignored ones."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(python_version: str, out: Path) -> dict:
    """Download the wheels into ``out/wheels`` (emptied first), check closure and size, write ``out/manifest.json``."""
    wheels_dir = out / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    wheels_dir.mkdir(parents=True)
    subprocess.run(download_command(python_version, wheels_dir), check=True)
    wheels = []
    for path in sorted(wheels_dir.glob("*.whl")):
        meta = wheel_metadata(path)
        entry = {"file": path.name, "name": meta["name"], "version": meta["version"], "bytes": path.stat().st_size}
        wheels.append({**entry, "sha256": sha256(path), "requires": meta["requires"]})
    got = {normalize(w["name"]): w["version"] for w in wheels}
    wanted = {normalize(k): v for k, v in BUNDLE_PINS.items()}
    if got != wanted:
        raise SystemExit(f"the download gave {got}, the pins are {wanted}")
    missing = unmet_requirements(wheels, python_version)
    if missing:
        raise SystemExit("the bundle's closure reaches packages the GPU image lacks:\n  " + "\n  ".join(missing))
    total = sum(w["bytes"] for w in wheels)
    tree = tree_bytes()
    manifest = {
        "python_version": python_version,
        "abi": abi_tag(python_version),
        "platforms": list(PLATFORMS),
        "wheels": [{k: w[k] for k in ("file", "name", "version", "bytes", "sha256")} for w in wheels],
        "total_bytes": total,
        "limit_bytes": MAX_BUNDLE_BYTES,
        "warm_start": {
            "bundled": False,
            "why": f"the tiny runs' warm start is shipped in {WARMSTART_DIR} and travels with the working tree",
            "bytes": folder_bytes(ROOT / WARMSTART_DIR),
        },
        "tree_bytes": tree,
        "carry_limit_bytes": CARRY_LIMIT_BYTES,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if total > MAX_BUNDLE_BYTES:
        raise SystemExit(f"bundle {total / 2**20:.1f} MiB exceeds {MAX_BUNDLE_BYTES / 2**20:.0f} MiB")
    if tree is not None and tree + total > CARRY_LIMIT_BYTES:
        raise SystemExit(
            f"working tree {tree / 2**20:.1f} MiB + bundle {total / 2**20:.1f} MiB exceed the "
            f"{CARRY_LIMIT_BYTES / 2**20:.0f} MiB that travel to the device machine"
        )
    return manifest


def describe(manifest: dict) -> str:
    lines = [f"{w['name']} {w['version']}: {w['bytes'] / 2**20:.2f} MiB ({w['file']})" for w in manifest["wheels"]]
    lines.append(
        f"bundle: {manifest['total_bytes'] / 2**20:.2f} MiB of {manifest['limit_bytes'] / 2**20:.0f} MiB, for CPython "
        f"{manifest['python_version']}"
    )
    ws = manifest["warm_start"]
    lines.append(f"warm start: not bundled ({ws['why']}; {ws['bytes'] / 2**20:.1f} MiB)")
    if manifest.get("tree_bytes") is not None:
        carried = manifest["tree_bytes"] + manifest["total_bytes"]
        lines.append(f"working tree + bundle: {carried / 2**20:.1f} MiB of {CARRY_LIMIT_BYTES / 2**20:.0f} MiB")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- install
def incompatible(wheel_file: str) -> str | None:
    """Why this interpreter cannot use the wheel (None when it can), from the file name's tags."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:  # no packaging: the CPython tag in the name must be ours or abi3/none
        ours = f"cp{sys.version_info.major}{sys.version_info.minor}"
        tags = wheel_file.removesuffix(".whl").split("-")[-3:]
        ok = tags[1] in ("none", "abi3") or tags[0] == ours
        return None if ok else f"{wheel_file} is for {tags[0]}, this Python is {ours}"
    _, _, _, tags = parse_wheel_filename(wheel_file)
    supported = set(sys_tags())
    if tags & supported:
        return None
    return f"{wheel_file} has none of this interpreter's tags (Python {sys.version.split()[0]})"


def unpack_wheel(wheel: Path, target: Path) -> None:
    """Install a wheel by unpacking it (PEP 427 without scripts): its files, and ``*.data/{purelib,platlib}``
    moved to the top; other ``.data`` folders (scripts, headers) are left out."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    for data in target.glob("*.data"):
        for lib in ("purelib", "platlib"):
            if (data / lib).is_dir():
                for item in (data / lib).iterdir():
                    shutil.move(str(item), str(target / item.name))
        shutil.rmtree(data)


def install(bundle: Path, target: Path | None = None, method: str = "auto") -> Path:
    """Install the bundle's wheels into `target` offline; return `target` (default: a folder in the temp dir named
    by this Python's ABI and the manifest's hash, so the carried bundle stays the wheels alone).

    Checks every wheel's sha256 against the manifest and its tags against this interpreter first. A target
    already holding this manifest's install (a stamp of its hash) is reused."""
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    want = sha256(manifest_path)
    if target is None:  # outside the bundle: the carried folder stays the wheels alone
        abi = f"cp{sys.version_info.major}{sys.version_info.minor}"
        target = Path(tempfile.gettempdir()) / f"fp8rl-gpu-bundle-{abi}-{want[:12]}"
    stamp = target / ".installed-manifest-sha256"
    if stamp.is_file() and stamp.read_text().strip() == want:
        return target
    problems = []
    wheels = []
    for entry in manifest["wheels"]:
        path = bundle / "wheels" / entry["file"]
        if not path.is_file():
            problems.append(f"missing {path.name}")
            continue
        if sha256(path) != entry["sha256"]:
            problems.append(f"{path.name}: sha256 differs from the manifest")
        reason = incompatible(path.name)
        if reason:
            problems.append(reason)
        wheels.append(path)
    if problems:
        raise SystemExit("cannot install the GPU bundle:\n  " + "\n  ".join(problems))
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    have_pip = (
        method != "unpack"
        and subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    )
    if method == "pip" and not have_pip:
        raise SystemExit("pip is not available to this interpreter")
    if have_pip:
        env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "-q"]
        subprocess.run([*cmd, "--target", str(target), *map(str, wheels)], check=True, env=env)
    else:
        for wheel in wheels:
            unpack_wheel(wheel, target)
    stamp.write_text(want + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the wheels and write the manifest (needs a package index)")
    b.add_argument("--python-version", default="3.12", help="the GPU image's Python (3.11 for a rehearsal here)")
    b.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle")
    i = sub.add_parser("install", help="install the bundle offline; prints the folder to put on PYTHONPATH")
    i.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle")
    i.add_argument("--target", type=Path, default=None)
    i.add_argument("--method", choices=("auto", "pip", "unpack"), default="auto")
    s = sub.add_parser("summary", help="one line: the bundle's packages and the Python they are for")
    s.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle")
    args = parser.parse_args(argv)
    if args.command == "summary":
        manifest = json.loads((args.bundle / "manifest.json").read_text())
        packages = ", ".join(f"{w['name']} {w['version']}" for w in manifest["wheels"])
        print(f"{packages} (CPython {manifest['python_version']}, {manifest['total_bytes'] / 2**20:.1f} MiB)")
        return 0
    if args.command == "build":
        print(describe(build(args.python_version, args.out)))
        return 0
    print(install(args.bundle, args.target, args.method))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
