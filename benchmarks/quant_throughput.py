"""Throughput of FP8 quantization (fp8rl.quant) on a 4096 x 4096 float32 tensor, on this machine's CPU.

For each granularity: GB/s of input quantized by the eager path, by the opt-in compiled path
(``quantize(..., compile=True)``, asserted bit-identical to eager: data bytes and scales), and by
torchao's CPU float8 conversion, each beside this machine's copy bandwidth measured in the same run.

Definitions (printed with the results):
- quantize GB/s = bytes of the float32 input / seconds per call (output allocation included).
- copy GB/s = (bytes read + bytes written) / seconds of ``dst.copy_(src)`` into a preallocated dst.
- Target: compiled quantize GB/s >= 10% of copy GB/s for every granularity.
All methods are timed round-robin (one call each per round, median of the rounds), so that load
from other processes on a shared machine affects them alike.

torchao reference: ``hp_tensor_to_float8_dynamic`` (torchao.float8, its training cast) for "tensor" and
"row" (axiswise), and ``_choose_scale_float8`` + ``_quantize_affine_float8`` (torchao.quantization's
float8 primitives, block_size = the block) for the block granularities; both divide by an
amax-derived scale (float32 scales, also for the 1x32 blocks) and saturate, as fp8rl does.

Usage: python benchmarks/quant_throughput.py [--size 4096] [--rounds 7] [--out results.json] [--thp]

"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

GRANULARITIES = ("tensor", "row", "block_1x128", "block_128x128", "mx_1x32")
TARGET_FRACTION_OF_COPY = 0.10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="the input is size x size float32")
    parser.add_argument("--fmt", default="e4m3", choices=["e4m3", "e5m2"], help="FP8 format")
    parser.add_argument("--rounds", type=int, default=7, help="timed round-robin rounds (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile fast path")
    parser.add_argument(
        "--thp",
        action="store_true",
        help="set THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator asks for transparent huge pages), which "
        "removes most page-fault cost of fresh output buffers on machines where faults are slow",
    )
    parser.add_argument("--out", default=None, help="also write the results and provenance as JSON here")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.thp:  # read once by torch's allocator: must be set before torch is imported
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

import torch  # noqa: E402

from fp8rl.quant import get_format, quantize  # noqa: E402
from fp8rl.tracking.provenance import allocator_settings  # noqa: E402


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "torch": torch.__version__,
        "torchao": _torchao_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"),
        "malloc": allocator_settings(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "command": " ".join(["python", *sys.argv]).replace(f"{Path.cwd()}/", ""),  # no path of this machine
    }


def _torchao_version() -> str | None:
    try:
        import torchao

        return torchao.__version__
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None


def torchao_quantizers(fmt_dtype: torch.dtype) -> tuple[dict[str, Callable], str | None]:
    """One callable per granularity returning torchao's FP8 data; or ({}, why) if torchao is unusable."""
    try:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig
        from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8
    except Exception as err:  # noqa: BLE001
        return {}, f"torchao not importable: {err!r}"
    mm_config = LinearMMConfig()

    def tensorwise(x):
        return hp_tensor_to_float8_dynamic(x, fmt_dtype, mm_config)._data

    def rowwise(x):
        return hp_tensor_to_float8_dynamic(
            x, fmt_dtype, mm_config, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1
        )._data

    def blockwise(block: list[int]):
        def run(x):
            return _quantize_affine_float8(x, _choose_scale_float8(x, block, fmt_dtype), fmt_dtype)

        return run

    return {
        "tensor": tensorwise,
        "row": rowwise,
        "block_1x128": blockwise([1, 128]),
        "block_128x128": blockwise([128, 128]),
        "mx_1x32": blockwise([1, 32]),
    }, None


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def same_bits(a, b) -> bool:
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def main() -> None:
    if ARGS.threads:
        torch.set_num_threads(ARGS.threads)
    fmt = get_format(ARGS.fmt)
    x = torch.randn(ARGS.size, ARGS.size, generator=torch.Generator().manual_seed(0))
    x[:, :4] *= 100  # outlier channels, as LLM activations have
    input_bytes = x.numel() * x.element_size()
    copy_dst = torch.empty_like(x)
    cast_dst = torch.empty(x.shape, dtype=fmt.dtype)

    methods: dict[str, Callable[[], object]] = {
        "copy": lambda: copy_dst.copy_(x),
        "cast_only": lambda: x.to(fmt.dtype),  # unscaled fp32 -> fp8 cast, fresh output
        "cast_only_into": lambda: cast_dst.copy_(x),  # the same cast into a preallocated buffer
    }
    checks: dict[str, dict] = {g: {} for g in GRANULARITIES}
    ao, ao_unavailable = torchao_quantizers(fmt.dtype)
    for granularity in GRANULARITIES:
        eager = quantize(x, fmt.name, granularity)
        methods[f"eager/{granularity}"] = lambda g=granularity: quantize(x, fmt.name, g)
        if not ARGS.no_compile:
            start = time.perf_counter()
            compiled = quantize(x, fmt.name, granularity, compile=True)
            checks[granularity]["compile_s"] = time.perf_counter() - start
            checks[granularity]["compiled_bit_identical"] = same_bits(compiled, eager)
            methods[f"compiled/{granularity}"] = lambda g=granularity: quantize(x, fmt.name, g, compile=True)
        if granularity in ao:
            try:
                ao_data = ao[granularity](x)
                checks[granularity]["torchao_codes_equal_fraction"] = float(
                    (ao_data.view(torch.uint8) == eager.data.view(torch.uint8)).float().mean()
                )
                methods[f"torchao/{granularity}"] = lambda g=granularity: ao[g](x)
            except Exception as err:  # noqa: BLE001
                checks[granularity]["torchao_error"] = f"does not run on CPU: {err!r}"

    for fn in methods.values():  # warm-up (first-touch of buffers, lazy inits)
        fn()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(ARGS.rounds):
        for name, fn in methods.items():
            samples[name].append(timed(fn))
    seconds = {name: statistics.median(s) for name, s in samples.items()}

    copy_gbps = 2 * input_bytes / seconds["copy"] / 1e9
    results = {
        "config": {"size": ARGS.size, "fmt": fmt.name, "rounds": ARGS.rounds, "input_bytes": input_bytes},
        "definitions": {
            "quantize_gbps": "float32 input bytes / median seconds per call (output allocation included)",
            "copy_gbps": "(bytes read + bytes written) / median seconds of dst.copy_(src), dst preallocated",
            "target": f"compiled quantize GB/s >= {TARGET_FRACTION_OF_COPY:.0%} of copy GB/s, every granularity",
        },
        "copy_gbps": copy_gbps,
        "cast_only_gbps": input_bytes / seconds["cast_only"] / 1e9,
        "cast_only_into_gbps": input_bytes / seconds["cast_only_into"] / 1e9,
        "torchao_unavailable": ao_unavailable,
        "granularities": {},
        "provenance": provenance(),
    }
    for granularity in GRANULARITIES:
        row = dict(checks[granularity])
        for method in ("eager", "compiled", "torchao"):
            key = f"{method}/{granularity}"
            if key in seconds:
                gbps = input_bytes / seconds[key] / 1e9
                row[f"{method}_gbps"] = gbps
                row[f"{method}_over_copy"] = gbps / copy_gbps
        if "compiled_gbps" in row and "torchao_gbps" in row:
            row["compiled_over_torchao"] = row["compiled_gbps"] / row["torchao_gbps"]
        results["granularities"][granularity] = row
    compiled_ok = [
        r.get("compiled_over_copy", 0) >= TARGET_FRACTION_OF_COPY and r.get("compiled_bit_identical", False)
        for r in results["granularities"].values()
    ]
    results["target_met"] = None if ARGS.no_compile else all(compiled_ok)
    print_table(results)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {ARGS.out}")


def print_table(results: dict) -> None:
    p = results["provenance"]
    print(f"FP8 quantization throughput, {results['config']['size']}^2 float32 -> {results['config']['fmt']}")
    print(
        f"torch {p['torch']}, torchao {p['torchao']}, {p['torch_threads']} threads, {p['platform']}, "
        f"THP_MEM_ALLOC_ENABLE={p['thp_mem_alloc_enable']}, malloc {p['malloc']}, load avg {p['load_average_1m']}, "
        f"git {p['git_sha']}"
    )
    print(f"copy bandwidth: {results['copy_gbps']:.2f} GB/s  ({results['definitions']['copy_gbps']})")
    print(
        f"unscaled fp32->fp8 cast: {results['cast_only_gbps']:.2f} GB/s of input "
        f"({results['cast_only_into_gbps']:.2f} GB/s into a preallocated buffer)"
    )
    print(f"quantize GB/s = {results['definitions']['quantize_gbps']}\n")
    header = (
        f"{'granularity':<15}{'eager':>8}{'compiled':>10}{'torchao':>9}"
        f"{'eager/copy':>12}{'compiled/copy':>15}{'torchao/copy':>14}{'compiled/torchao':>18}"
        f"{'bit-identical':>15}{'compile s':>11}"
    )
    print(header)
    print("-" * len(header))

    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) else "n/a"

    for granularity, row in results["granularities"].items():
        print(
            f"{granularity:<15}{fmt(row.get('eager_gbps'), '8.2f')}{fmt(row.get('compiled_gbps'), '10.2f')}"
            f"{fmt(row.get('torchao_gbps'), '9.2f')}{fmt(row.get('eager_over_copy'), '12.1%')}"
            f"{fmt(row.get('compiled_over_copy'), '15.1%')}{fmt(row.get('torchao_over_copy'), '14.1%')}"
            f"{fmt(row.get('compiled_over_torchao'), '18.2f')}{str(row.get('compiled_bit_identical', 'n/a')):>15}"
            f"{fmt(row.get('compile_s'), '11.1f')}"
        )
        if "torchao_error" in row:
            print(f"  torchao {granularity}: {row['torchao_error']}")
    if results["torchao_unavailable"]:
        print(f"torchao: {results['torchao_unavailable']}")
    equal = {g: r.get("torchao_codes_equal_fraction") for g, r in results["granularities"].items()}
    print("\nfraction of torchao's FP8 codes equal to fp8rl's:", {g: fmt(v, ".4f") for g, v in equal.items()})
    print("(mx_1x32: torchao's block primitive uses float32 scales, fp8rl's MXFP8 power-of-two E8M0 scales)")
    met = results["target_met"]
    verdict = "n/a (--no-compile)" if met is None else ("MET" if met else "NOT MET")
    print(f"\ntarget ({results['definitions']['target']}, bit-identical to eager): {verdict}")


if __name__ == "__main__":
    main()
