"""benchmarks/gemm_floor.py: each recipe's GEMM dtype comes from the emulator, and the summary reads the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from . import load_benchmark


def test_block_scales_that_are_not_powers_of_two_need_float32_gemms(tmp_path: Path) -> None:
    out = tmp_path / "gemm_floor.json"
    result = load_benchmark("gemm_floor").main(["--rows", "64", "--rounds", "1", "--out", str(out)])
    dtypes = {name: row["gemm_dtype"] for name, row in result["recipes"].items()}
    # TorchAO's presets: blockwise with FP32 scales, MXFP8 with E8M0 (power-of-two) scales
    assert dtypes == {"tensorwise": "bfloat16", "rowwise": "bfloat16", "blockwise": "float32", "mxfp8": "bfloat16"}
    assert result["recipes"]["tensorwise"]["gemm_time_over_bf16"] == 1.0
    text = load_benchmark("summarize").summarize(tmp_path)
    ratio = json.loads(out.read_text())["recipes"]["blockwise"]["gemm_time_over_bf16"]
    assert f"| blockwise | float32 | {ratio:.2f} |" in text
