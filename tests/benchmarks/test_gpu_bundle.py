"""benchmarks/gpu_bundle.py without a package index: its pins are the project's, the closure check finds what the image
lacks, and a bundle installs offline (by pip and by unpacking), refusing a changed wheel or one for another Python."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from . import ROOT, load_benchmark


def test_the_bundle_pins_are_the_projects() -> None:
    bundle = load_benchmark("gpu_bundle")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [*project["dependencies"], *project["optional-dependencies"]["bench"]]
    for name in ("megatron-core", "torchao", "math-verify"):
        assert f"{name}=={bundle.BUNDLE_PINS[name]}" in pins
    try:
        math_verify = importlib.metadata.requires("math-verify") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("math-verify is not installed here")
    assert f"latex2sympy2_extended=={bundle.BUNDLE_PINS['latex2sympy2_extended']}" in math_verify


def test_the_download_is_binary_only_for_the_images_python() -> None:
    bundle = load_benchmark("gpu_bundle")
    cmd = bundle.download_command("3.12", Path("out"))
    assert {"--only-binary=:all:", "--no-deps"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "cp312" in cmd and "manylinux_2_28_x86_64" in cmd
    assert "megatron-core==0.16.1" in cmd and "torchao==0.18.0" in cmd


def test_the_closure_check_names_what_the_image_lacks() -> None:
    bundle = load_benchmark("gpu_bundle")
    wheels = [
        {"name": "megatron-core", "version": "0.16.1", "requires": ["torch>=2.6.0", "numpy", "packaging>=24.2"]},
        {"name": "latex2sympy2_extended", "version": "1.11.0", "requires": ["sympy", "antlr4-python3-runtime<=4.13.2"]},
        {"name": "antlr4-python3-runtime", "version": "4.13.2", "requires": ['typing; python_version < "3.5"']},
        {"name": "x", "version": "1", "requires": ['pytest; extra == "dev"', 'einops; python_version >= "3.12"']},
    ]
    assert bundle.unmet_requirements(wheels, "3.12") == ['x 1 requires einops; python_version >= "3.12"']
    assert bundle.unmet_requirements(wheels, "3.11") == []


def make_wheel(folder: Path, name: str, tag: str = "py3-none-any", data: bool = False) -> Path:
    """A minimal wheel with module `name` (in ``*.data/purelib`` when `data`)."""
    dist = f"{name}-1.0"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
        (f"{dist}.data/purelib/" if data else "") + f"{name}.py": "VALUE = 42\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def make_bundle(tmp_path: Path, wheels: list[Path]) -> Path:
    bundle = load_benchmark("gpu_bundle")
    folder = tmp_path / "bundle"
    (folder / "wheels").mkdir(parents=True)
    entries = []
    for wheel in wheels:
        target = folder / "wheels" / wheel.name
        target.write_bytes(wheel.read_bytes())
        entries.append(
            {
                "file": wheel.name,
                "name": wheel.name.split("-")[0],
                "version": "1.0",
                "bytes": target.stat().st_size,
                "sha256": bundle.sha256(target),
            }
        )
    (folder / "manifest.json").write_text(json.dumps({"python_version": "3.x", "wheels": entries, "total_bytes": 1}))
    return folder


@pytest.mark.parametrize("method", ["pip", "unpack"])
def test_a_bundle_installs_offline_and_imports(tmp_path: Path, method: str) -> None:
    bundle = load_benchmark("gpu_bundle")
    src = tmp_path / "src"
    src.mkdir()
    folder = make_bundle(tmp_path, [make_wheel(src, "fp8rl_probe_a"), make_wheel(src, "fp8rl_probe_b", data=True)])
    site = bundle.install(folder, tmp_path / "site", method)
    env = {**os.environ, "PYTHONPATH": str(site), "PIP_NO_INDEX": "1"}
    code = "import fp8rl_probe_a as a, fp8rl_probe_b as b, importlib.metadata as m; "
    code += "print(a.VALUE + b.VALUE, m.version('fp8rl_probe_b'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["84", "1.0"]
    stamp = site / ".installed-manifest-sha256"
    before = stamp.stat().st_mtime_ns
    assert bundle.install(folder, site, method) == site and stamp.stat().st_mtime_ns == before  # reused


def test_a_changed_wheel_or_one_for_another_python_is_refused(tmp_path: Path) -> None:
    bundle = load_benchmark("gpu_bundle")
    src = tmp_path / "src"
    src.mkdir()
    folder = make_bundle(
        tmp_path, [make_wheel(src, "fp8rl_probe_c"), make_wheel(src, "fp8rl_probe_d", "cp27-cp27mu-manylinux1_x86_64")]
    )
    with (folder / "wheels" / "fp8rl_probe_c-1.0-py3-none-any.whl").open("ab") as fh:
        fh.write(b"tampered")
    with pytest.raises(SystemExit) as refused:
        bundle.install(folder, tmp_path / "site")
    message = str(refused.value)
    assert "fp8rl_probe_c-1.0-py3-none-any.whl: sha256 differs" in message and "fp8rl_probe_d" in message
    assert not (tmp_path / "site").exists()
