"""The measurements of `benchmarks/gpu_check.sh` on one GPU, each section in its own process under its own timeout.

Sections, in order (`SECTIONS`; the first five are required for a pass, the rest need Transformer Engine or vLLM
and are reported as skipped on a host without them):

- ``environment``: the device, torch / CUDA, which modules import, the GPU bundle, ``check_gpu_environment`` per
  TE recipe (information, not scored).
- ``probe``, ``quantizers``, ``gemm``, ``train_step`` (eager), ``rl``: `gpu_sections` (torch + the bundle:
  torchao, megatron-core, math-verify).
- ``torchao_rl``: fp8rl's ``precision.backend=torchao`` in the tiny RL run beside the emulated backend (not required).
- ``gpu_tests``: the GPU-marked tests (pytest, JUnit counts).
- ``train_step_compiled``: the training step ``torch.compile``d per layer (GPU only; last, so that compile time
  costs no other section).
- ``te_train_step``: BF16 vs FP8 tensorwise vs blockwise training steps through megatron's Transformer Engine spec
  (targets: tensorwise >= 1.3x, blockwise >= 1.1x BF16 throughput).
- ``vllm``: vLLM decode BF16 vs FP8 (``fp8_per_tensor``) on a small Qwen3-shaped model, in-process,
  ``enforce_eager=True`` (target: 1.2x).
- ``mismatch``: one RL step with vLLM FP8 rollout and the TE FP8 trainer: ``rollout/token_mult_prob_error``, ...

Each section's status: **passed** (every check held, on a GPU), **rehearsed** (every check held on the CPU of a
machine without a GPU: the code ran, nothing about a GPU was measured), **failed** (an error, a timeout, or a check
that did not hold), **skipped** (its stack or device is missing; the reason is given). The overall verdict
(`verdict`): **failed** if any section failed; **measured nothing on a GPU** if no section passed on a GPU (a CPU
rehearsal ends here, exit 3); **partial** if a required section did not pass (exit 4); else **passed** (exit 0).

Without a GPU every section that can runs its CPU part (the rehearsal): the probe and the GEMM check on the CPU's
``torch._scaled_mm``, the quantizers CPU against CPU, the train step on torchao's emulation with the tiny preset's
shapes, the RL arms on the CPU only. Writes ``gpu_check.json`` and ``gpu_check.md`` (provenance, no local paths)
into ``--out`` after every section, so that a run stopped by its timeout keeps what finished.

    python benchmarks/gpu_bench.py --out results/gpu [--sections probe,gemm] [--budget-s 500]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_sections  # noqa: E402
from _provenance import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {"train_step tensorwise": 1.3, "train_step blockwise": 1.1, "vllm decode fp8": 1.2}


def have(*modules: str) -> str | None:
    """None when every module imports, else the reason to skip (never raises).

    Imports them: ``importlib.util.find_spec("megatron.core")`` itself raises ModuleNotFoundError when the
    parent package is missing, and a module that is found may still fail to import (a CUDA library).
    """
    reasons = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name and module.startswith(err.name)
            reasons.append(f"not installed: {module}" if missing else f"{module}: {err}")
        except Exception as err:  # noqa: BLE001 - any import failure is a reason to skip, reported as such
            reasons.append(f"{module} fails to import: {type(err).__name__}: {err}")
    return "; ".join(reasons) or None


def cuda_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` on the GPU (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


# ------------------------------------------------------------------------------------- 2. train step
def qwen3_8b_stack(layers: int):
    from fp8rl.models.config import get_model_config

    cfg = get_model_config("qwen3_8b")
    return cfg.__class__(**{**cfg.__dict__, "num_layers": layers, "name": f"qwen3_8b_{layers}layers"})


def train_step_te(layers: int, seq: int, micro: int, repeats: int) -> dict[str, Any]:
    from fp8rl.models.parallel import ParallelLayout
    from fp8rl.models.runtime import init_megatron
    from fp8rl.models.te_backend import build_te_gpt_model, te_fp8

    cfg = qwen3_8b_stack(layers)
    layout = ParallelLayout(gpus_per_node=1, max_seq_len=seq, activation_recompute=False)
    init_megatron()  # build_te_gpt_model needs megatron's process state (TP = PP = 1 here)
    model = build_te_gpt_model(cfg, layout, None, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    ids = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(micro, seq)

    def step(recipe):
        def run():
            with te_fp8(model, recipe):
                loss = model(ids, pos, None).float().logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return run

    try:
        seconds = {
            name: cuda_time(step(recipe), repeats)
            for name, recipe in (("bf16", None), ("tensorwise", "tensorwise"), ("blockwise", "blockwise"))
        }
    finally:  # leave no model-parallel state behind for the later sections (the RL step builds its own)
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return {
        "backend": "megatron TE spec",
        "layers": layers,
        "seq": seq,
        "micro_batch": micro,
        "seconds": seconds,
        "speedup": {k: seconds["bf16"] / v for k, v in seconds.items()},
    }


# ------------------------------------------------------------------------------------------- 3. vLLM
def small_qwen3_folder(directory: Path) -> Path:
    """An 8-layer, 2048-wide Qwen3-shaped HF folder with random weights (needs no megatron)."""
    import safetensors.torch

    from fp8rl.models.hf import hf_config_from_model_config

    base = qwen3_8b_stack(8)
    cfg = base.__class__(
        **{
            **base.__dict__,
            "name": "qwen3_small",
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_query_groups": 4,
            "ffn_hidden_size": 6144,
            "vocab_size": 32768,
            "max_seq_len": 4096,
        }
    )
    gen = torch.Generator().manual_seed(0)
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": rand(q, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
                p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                p + "mlp.gate_proj.weight": rand(f, h),
                p + "mlp.up_proj.weight": rand(f, h),
                p + "mlp.down_proj.weight": rand(h, f),
            }
        )
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config_from_model_config(cfg, dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def shutdown_vllm(llm: Any) -> None:
    """Stop an in-process vLLM 0.32 engine and free its GPU memory.

    ``vllm.LLM`` 0.32 has no ``shutdown()``; its engine-core client has: InprocClient.shutdown detaches the
    client's finalizer and runs EngineCore.shutdown (executor and scheduler shutdown, then
    ``cleanup_dist_env_and_memory``: vLLM's process groups and the default one destroyed, CUDA cache
    emptied); SyncMPClient.shutdown stops the engine process.
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def vllm_decode(repeats: int) -> dict[str, Any]:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: a timeout kills one process
    from vllm import LLM, SamplingParams

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = small_qwen3_folder(Path(tmp) / "model")
        prompts = [[1 + (i * 7 + j) % 30 for j in range(32)] for i in range(256)]
        params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
        for name, quant in (("bf16", None), ("fp8", "fp8_per_tensor")):
            llm = LLM(
                str(folder),
                dtype="bfloat16",
                quantization=quant,
                gpu_memory_utilization=0.4,
                max_model_len=512,
                enforce_eager=True,
                seed=0,
                skip_tokenizer_init=True,
                distributed_executor_backend="uni",
            )
            try:
                llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
                t = time.perf_counter()
                for _ in range(repeats):
                    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                seconds = (time.perf_counter() - t) / repeats
                out[name] = {"seconds": seconds, "tokens_per_s": len(prompts) * 256 / seconds}
            finally:
                shutdown_vllm(llm)
                del llm
                gc.collect()
                torch.cuda.empty_cache()
    out["speedup_fp8"] = out["fp8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    out["note"] = "in-process vLLM, enforce_eager=True (no CUDA graphs): decode ratios without graph capture"
    return out


# --------------------------------------------------------------------------------------- 4. mismatch
MISMATCH_RUN = {  # one RL step of the tiny model: vLLM FP8 rollout, TE FP8 trainer, token TIS
    "model.device": "cuda",
    "rollout.engine": "vllm",
    "precision.mode": "fp8_full",
    "precision.recipe": "tensorwise",
    "precision.backend": "te",
    "clipping.rollout_correction": "tis_token",
    "tracking.enabled": False,
    "warmstart.steps": 100,
}


def mismatch_config(out_dir: str):
    """The run config of the mismatch section (frozen dataclasses: built by overrides, checked as a job is)."""
    from fp8rl.choices import validated
    from fp8rl.config import RunConfig, with_overrides

    return validated(with_overrides(RunConfig(), {**MISMATCH_RUN, "trainer.out_dir": out_dir}))


def mismatch() -> dict[str, Any]:
    from fp8rl.job import build_trainer

    trainer = build_trainer(mismatch_config(tempfile.mkdtemp()))
    try:
        metrics = trainer.train_step(1).metrics
    finally:
        getattr(trainer.engine, "close", lambda: None)()  # the rollout engine's resources, as the job does
    keys = ("rollout/token_mult_prob_error", "rollout/k3_kl", "rollout/abs_logp_diff", "rollout/max_abs_logp_diff")
    return {k: metrics[k] for k in keys if k in metrics}


def environment() -> dict[str, Any]:
    """This host's stack: device, torch, which modules import, the bundle, and which TE recipes could run here."""
    import platform

    from fp8rl.models.te_recipes import check_gpu_environment, gpu_environment_report

    report = gpu_environment_report()
    te = {}
    for recipe in ("tensorwise", "blockwise", "mxfp8"):
        try:
            check_gpu_environment(recipe, "te", report)
            te[recipe] = "ok"
        except ValueError as err:
            te[recipe] = str(err)
    modules = {}
    for module in (
        "megatron.core",
        "torchao",
        "math_verify",
        "triton",
        "transformers",
        "pytest",
        "transformer_engine",
        "vllm",
        "hydra",
        "mlflow",
        "rich",
    ):
        modules[module] = have(module) or "yes"
    return {
        "info": True,
        "python": platform.python_version(),
        **report,
        "device_name": report.get("device"),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30
        if torch.cuda.is_available()
        else None,
        "modules": modules,
        "bundle": os.environ.get("FP8RL_GPU_BUNDLE", "not reported (gpu_bench.py run without gpu_check.sh)"),
        "te_recipes": te,
    }


# ------------------------------------------------------------------------------------------- 5. gpu tests
GPU_TEST_FILES = ("tests/quant/test_te_parity.py", "tests/models/test_te_backend.py", "tests/trainer/test_gpu_step.py")


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts of a JUnit XML report (pytest's) and the distinct skip reasons."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["skipped_tests"] = counts.pop("skipped")  # "skipped" is a result's skip reason
    reasons = sorted({(e.get("message") or "").strip()[:200] for e in root.iter("skipped")})
    failed = [
        f"{c.get('classname')}.{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped_tests"]
    return {**counts, "skip_reasons": reasons, "failed_tests": failed}


def gpu_tests(out: Path, timeout_s: float) -> dict[str, Any]:
    """The GPU-marked tests, as their own pytest process (a hang is cut at `timeout_s`)."""
    reason = have("pytest")
    if reason:
        return {"skipped": reason}
    junit = out / "gpu_tests.xml"
    junit.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(junit),
        *GPU_TEST_FILES,
    ]
    with open(out / "gpu_tests.log", "w") as log:
        code = run_child(cmd, timeout_s, stdout=log)
    if code == "timeout":
        return {"error": f"timed out after {timeout_s:.0f} s (log: gpu_tests.log)"}
    if not junit.is_file():
        return {"error": f"pytest exited {code} without a JUnit report (log: gpu_tests.log)"}
    summary = {"device": "cuda" if torch.cuda.is_available() else "cpu", "pytest_exit": code, **junit_summary(junit)}
    if summary["failures"] or summary["errors"]:
        summary["error"] = f"{summary['failures']} failed, {summary['errors']} errors: {summary['failed_tests'][:5]}"
    elif summary["passed"] == 0:
        return {"skipped": "every GPU test skipped: " + "; ".join(summary["skip_reasons"])[:600], **summary}
    summary["checks"] = [gpu_sections.check("no GPU test failed", not (summary["failures"] or summary["errors"]))]
    return summary


# ------------------------------------------------------------------------------------------- the driver
@dataclass(frozen=True)
class Section:
    """A section: its runner (called in the section's own process), what it needs and how long it may take."""

    name: str
    run: Callable[[argparse.Namespace, str], dict[str, Any]]
    timeout_s: float  # on one H200 (the driver gives a section no more than what the budget has left)
    needs: tuple[str, ...] = ()  # modules that must import
    cuda_only: bool = False  # False: runs its CPU part on a machine without a GPU (the rehearsal)
    required: bool = False  # required for an overall pass


def _te_train_step(args: argparse.Namespace, device: str) -> dict[str, Any]:
    result = train_step_te(args.layers, args.seq, args.micro, args.repeats)
    targets = verdicts({"te_train_step": result})
    result["checks"] = [
        gpu_sections.check(f"{k}: {v['ratio']:.2f}x >= {v['target']}x", v["met"]) for k, v in targets.items()
    ]
    return {"device": device, **result}


def _vllm(args: argparse.Namespace, device: str) -> dict[str, Any]:
    result = vllm_decode(args.repeats)
    targets = verdicts({"vllm": result})
    result["checks"] = [
        gpu_sections.check(f"{k}: {v['ratio']:.2f}x >= {v['target']}x", v["met"]) for k, v in targets.items()
    ]
    return {"device": device, **result}


def _mismatch(args: argparse.Namespace, device: str) -> dict[str, Any]:
    metrics = mismatch()
    return {
        "device": device,
        "metrics": metrics,
        "checks": [gpu_sections.check("mismatch metrics measured", bool(metrics))],
    }


SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section("environment", lambda a, d: environment(), 60),
        Section("probe", lambda a, d: gpu_sections.probe(d), 60, required=True),
        Section("quantizers", lambda a, d: gpu_sections.quantizers(d), 150, required=True),
        Section("gemm", lambda a, d: gpu_sections.gemm(d), 90, required=True),
        Section(
            "train_step",
            lambda a, d: gpu_sections.train_step(d, a.layers, a.seq, a.micro, a.repeats, ("eager",)),
            120,
            needs=("torchao",),
            required=True,
        ),
        Section(
            "rl",
            lambda a, d: gpu_sections.rl(d, a.rl_steps),
            180,
            needs=("megatron.core", "math_verify"),
            required=True,
        ),
        Section("torchao_rl", lambda a, d: gpu_sections.torchao_rl(d), 150, needs=("megatron.core", "torchao")),
        Section("gpu_tests", lambda a, d: {}, 120),  # run by the driver itself (pytest is its own process)
        # Last: torch.compile's first compilations are the slowest part of the check, and a timeout here costs
        # no other section its numbers.
        Section(
            "train_step_compiled",
            lambda a, d: gpu_sections.train_step(d, a.layers, a.seq, a.micro, a.repeats, ("compiled",)),
            200,
            needs=("torchao",),
            cuda_only=True,
        ),
        Section("te_train_step", _te_train_step, 150, needs=("megatron.core", "transformer_engine"), cuda_only=True),
        Section("vllm", _vllm, 150, needs=("vllm",), cuda_only=True),
        Section("mismatch", _mismatch, 120, needs=("vllm", "transformer_engine", "megatron.core"), cuda_only=True),
    )
}
SECTION_NAMES = tuple(SECTIONS)
REQUIRED = tuple(n for n, s in SECTIONS.items() if s.required)


def run_child(cmd: list[str], timeout_s: float, **popen: Any) -> int | str:
    """Run `cmd` in its own process group; "timeout" (the group killed) when it outlives `timeout_s`."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        return proc.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return "timeout"


def section_in_child(name: str, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    """Run section `name` in a fresh process (its own CUDA context, compile caches, megatron state)."""
    with tempfile.TemporaryDirectory(prefix="fp8rl-gpu-section-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-section", name, "--result", str(result_file)]
        cmd += [f"--layers={args.layers}", f"--seq={args.seq}", f"--micro={args.micro}", f"--repeats={args.repeats}"]
        cmd += [f"--rl-steps={args.rl_steps}"]
        code = run_child(cmd, timeout_s)
        if code == "timeout":
            return {"error": f"timed out after {timeout_s:.0f} s"}
        if not result_file.is_file():
            return {"error": f"the section's process exited {code} without a result"}
        return json.loads(result_file.read_text())


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """In the section's process: run it; a Skip or an exception becomes its result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return SECTIONS[name].run(args, device)
    except gpu_sections.Skip as skip:
        return {"skipped": str(skip)}
    except Exception as err:  # noqa: BLE001 - reported, and the other sections still run
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}


def precheck(section: Section) -> str | None:
    """Why `section` cannot run on this host (checked in the driver: no process is started for it)."""
    if section.cuda_only and not torch.cuda.is_available():
        return "needs a CUDA device (none found)"
    return have(*section.needs)


def status(result: dict[str, Any]) -> str:
    """passed / rehearsed / failed / skipped / info of one section's result."""
    if "error" in result:
        return "failed"
    if "skipped" in result:
        return "skipped"
    if not all(c.get("ok") for c in result.get("checks", [])):
        return "failed"
    if result.get("info"):
        return "info"
    return "passed" if result.get("device") == "cuda" else "rehearsed"


def verdict(results: dict[str, Any], required: tuple[str, ...] = REQUIRED) -> dict[str, Any]:
    """The overall verdict: failed > measured nothing on a GPU > partial > passed (module docstring)."""
    states = {name: status(r) for name, r in results.items()}
    failed = [n for n, s in states.items() if s == "failed"]
    on_gpu = [n for n, s in states.items() if s == "passed"]
    not_passed = [n for n in required if states.get(n) != "passed"]
    if failed:
        word = "failed"
    elif not on_gpu:
        word = "measured nothing on a GPU"
    elif not_passed:
        word = "partial"
    else:
        word = "passed"
    return {
        "verdict": word,
        "statuses": states,
        "failed": failed,
        "passed_on_gpu": on_gpu,
        "required_not_passed": not_passed,
    }


EXIT_CODES = {"passed": 0, "failed": 1, "measured nothing on a GPU": 3, "partial": 4}


def run_sections(
    names: list[str],
    runners: dict[str, Callable[[], dict[str, Any]]],
    write: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the named sections in order; after each one, ``write(results so far)`` (a timeout keeps them)."""
    results: dict[str, Any] = {}
    for name in names:
        t = time.perf_counter()
        try:
            if name not in runners:
                raise KeyError(f"unknown section {name!r}; valid: {list(runners)}")
            results[name] = runners[name]()
        except Exception as err:  # noqa: BLE001 - one broken section must not hide the others
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        results[name]["wall_s"] = time.perf_counter() - t
        results[name]["status"] = status(results[name])
        print(f"{name}: {results[name]['status']} {json.dumps(scrub(results[name]), default=str)[:300]}", flush=True)
        if write is not None:
            write(results)
    return results


def driver_runners(args: argparse.Namespace, out: Path, deadline: float) -> dict[str, Callable[[], dict[str, Any]]]:
    """name -> a callable running the section in its own process within the time left before `deadline`."""
    reserve_s = 5.0  # for the last report write

    def runner(name: str) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            section = SECTIONS[name]
            reason = precheck(section)
            if reason:
                return {"skipped": reason}
            left = deadline - time.monotonic() - reserve_s
            if left < 10:
                return {"skipped": f"the check's time budget was spent before this section ({left:.0f} s left)"}
            timeout = min(section.timeout_s, left)
            if name == "gpu_tests":
                return gpu_tests(out, timeout)
            return section_in_child(name, args, timeout)

        return go

    return {name: runner(name) for name in SECTIONS}


# ------------------------------------------------------------------------------------------- the report
def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """The TE training step's and vLLM's ratios against the issue targets (torchao's are reported, not scored)."""
    out = {}
    te = results.get("te_train_step", {})
    speed = te.get("speedup", {}) if te.get("backend") == "megatron TE spec" else {}
    for recipe in ("tensorwise", "blockwise"):
        if recipe in speed:
            out[f"train_step {recipe}"] = {
                "ratio": speed[recipe],
                "target": TARGETS[f"train_step {recipe}"],
                "met": speed[recipe] >= TARGETS[f"train_step {recipe}"],
            }
    if "speedup_fp8" in results.get("vllm", {}):
        ratio = results["vllm"]["speedup_fp8"]
        out["vllm decode fp8"] = {"ratio": ratio, "target": 1.2, "met": ratio >= 1.2}
    return out


def local_paths() -> list[tuple[str, str]]:
    """(absolute path of this machine, what the report says instead), longest first."""
    pairs = {
        str(ROOT): "<repo>",
        sys.prefix: "<python>",
        sys.base_prefix: "<python>",
        tempfile.gettempdir(): "<tmp>",
        str(Path.home()): "~",
    }
    for extra in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if extra and os.path.isabs(extra) and extra not in pairs:
            pairs[extra] = "<pythonpath>"
    return sorted(((k, v) for k, v in pairs.items() if k not in ("", "/")), key=lambda kv: -len(kv[0]))


def scrub(value: Any, paths: list[tuple[str, str]] | None = None) -> Any:
    """`value` with this machine's absolute paths replaced (tracebacks, error texts, environment strings)."""
    paths = local_paths() if paths is None else paths
    if isinstance(value, str):
        for path, name in paths:
            value = value.replace(path, name)
        return value
    if isinstance(value, dict):
        return {k: scrub(v, paths) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v, paths) for v in value]
    return value


def scrub_files(folder: Path) -> list[Path]:
    """Replace this machine's paths in the logs beside the report (the tee'd driver log, pytest's log and JUnit
    XML): the report is scrubbed as it is written, the logs are what the sections and pytest printed."""
    scrubbed = []
    for path in sorted(folder.glob("*.log")) + sorted(folder.glob("*.xml")):
        text = path.read_text(errors="replace")
        clean = scrub(text)
        if clean != text:
            path.write_text(clean)
            scrubbed.append(path)
    return scrubbed


def fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, int | float) else str(value)


def summary_line(name: str, r: dict[str, Any]) -> str:
    """One line per section for the report's table."""
    if "error" in r:
        return "error: " + r["error"].splitlines()[0][:200]
    if "skipped" in r:
        return "skipped: " + r["skipped"][:200]
    bad = [c["what"] for c in r.get("checks", []) if not c.get("ok")]
    if bad:
        return "did not hold: " + "; ".join(bad)[:300]
    if name == "environment":
        memory = r.get("gpu_memory_gib")
        return f"{r.get('device')}: torch {r.get('torch')}, CUDA {r.get('cuda')}, {fmt(memory, '.0f')} GiB"
    if name == "probe":
        legacy = r["apis"].get("torch._scaled_mm", {})
        return "torch._scaled_mm accepts: " + (
            ", ".join(k for k, v in legacy.items() if v.startswith("accepted")) or "none"
        )
    if name == "quantizers":
        compiled = len(r["compiled"]) if isinstance(r["compiled"], list) else 0
        return f"{len(r['cases'])} eager cases (+ {compiled} compiled) bit-equal to the CPU"
    if name == "gemm":
        ran = [f"{rec} {g}" for rec, row in r["table"].items() for g, v in row.items() if "rel" in v["hardware"]]
        where = "the GPU's" if r.get("device") == "cuda" else "the CPU's"
        return f"{len(ran)} of {3 * len(r['table'])} GEMMs ran on {where} scaled_mm, each within its bound"
    if name in ("train_step", "train_step_compiled"):
        parts = [
            f"{m} {rec} {v:.2f}x"
            for m, d in r["speedup_over_bf16"].items()
            if isinstance(d, dict)
            for rec, v in d.items()
            if rec != "bf16"
        ]
        return "throughput over BF16: " + ", ".join(parts)
    if name == "rl":
        where = "GPU and CPU" if r["device"] == "cuda" else "the CPU only"
        return f"{r['steps']} steps x {len(r['arms'])} arms on {where}"
    if name == "torchao_rl":
        times = [
            f"{rec} {fmt(c['step_time_s']['torchao'])} s/step (emulated {fmt(c['step_time_s']['emulated'])})"
            for rec, c in r["comparison"].items()
        ]
        return f"precision.backend=torchao, {r['steps']} steps on {r['device']}: " + ", ".join(times)
    return f"{len(r.get('checks', []))} checks held"


def paired_step_table(title: str, per_step: list[dict[str, Any]], left: str, right: str) -> list[str]:
    """A titled table of the RL key metrics per step, each cell ``left / right`` (GPU / CPU, torchao / emulated)."""
    metrics = gpu_sections.RL_KEY_METRICS
    lines = ["", title, "", "| step | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for row in per_step:
        cells = [f"{fmt(row[k][left])} / {fmt(row[k][right])}" for k in metrics]
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    return lines


def section_tables(name: str, r: dict[str, Any]) -> list[str]:
    """Markdown tables for the sections that have them."""
    lines: list[str] = []
    if name == "probe" and "apis" in r:
        apis = list(r["apis"])
        lines += ["| scaling | " + " | ".join(apis) + " |", "|---|" + "---|" * len(apis)]
        for case in gpu_sections.PROBE_CASES:
            lines.append(f"| {case} | " + " | ".join(r["apis"][a].get(case, "-")[:160] for a in apis) + " |")
    if name == "gemm" and "table" in r:
        lines += [
            "| recipe | GEMM | K | scaled_mm rel. error | bound | API, output | emulator rel. error (bound) |",
            "|---|---|---|---|---|---|---|",
        ]
        for rec, rows in r["table"].items():
            for g, row in rows.items():
                hw = row["hardware"]
                if "rel" in hw:
                    fast = f"; fast accum {hw['fast_accum_rel']:.2e}" if "fast_accum_rel" in hw else ""
                    cell = (f"{hw['rel']:.2e}{fast}", f"{hw['bound']:.2e}", f"{hw['api']}, {hw['out_dtype']}")
                else:
                    cell = ("refused", "-", (hw["refused"][0] if hw["refused"] else "-")[:120])
                lines.append(
                    f"| {rec} | {g} | {row['reduction']} | {cell[0]} | {cell[1]} | {cell[2]} | "
                    f"{row['emulator_rel']:.2e} ({row['emulator_bound']:.2e}) |"
                )
    if name in ("train_step", "train_step_compiled") and "seconds" in r:
        lines += ["| mode | recipe | s/step | tokens/s | x BF16 |", "|---|---|---|---|---|"]
        for mode, d in r["seconds"].items():
            for rec, s in d.items():
                lines.append(
                    f"| {mode} | {rec} | {s:.4f} | {r['tokens_per_s'][mode][rec]:.0f} | "
                    f"{r['speedup_over_bf16'][mode][rec]:.2f} |"
                )
    if name == "rl" and "comparison" in r:
        for arm, comp in r["comparison"].items():
            title = (
                f"{arm} (median s/step: GPU {fmt(comp['step_time_s']['gpu'])}, CPU {fmt(comp['step_time_s']['cpu'])})"
            )
            lines += paired_step_table(title, comp["per_step"], "gpu", "cpu")
        lines += ["", "(GPU / CPU per cell.) " + r["expected"]]
    elif name == "rl" and "cpu" in r and isinstance(r["cpu"], dict):
        lines += [
            "| arm | step | " + " | ".join(gpu_sections.RL_KEY_METRICS) + " |",
            "|---|---|" + "---|" * len(gpu_sections.RL_KEY_METRICS),
        ]
        for arm, run in r["cpu"].items():
            for step, m in enumerate(run["steps"]):
                lines.append(
                    f"| {arm} | {step} | " + " | ".join(fmt(m.get(k)) for k in gpu_sections.RL_KEY_METRICS) + " |"
                )
    if name == "torchao_rl" and "comparison" in r:
        lines += ["| GEMM probe (100 tokens) | outcome |", "|---|---|"]
        lines += [f"| {case} | {outcome[:200]} |" for case, outcome in r["padding"].items()]
        for recipe, comp in r["comparison"].items():
            lines += paired_step_table(
                f"{recipe} (torchao / emulated per cell)", comp["per_step"], "torchao", "emulated"
            )
        lines += ["", r["expected"]]
    return lines


def markdown(
    results: dict[str, Any],
    targets: dict[str, Any],
    prov: dict[str, str],
    device: str,
    overall: dict[str, Any] | None = None,
) -> str:
    overall = overall or verdict(results)
    lines = [
        "# GPU check (benchmarks/gpu_check.sh)",
        "",
        f"**Verdict: {overall['verdict']}.** Device: {device}. git {prov.get('git_sha', '?')[:10]}"
        f"{' (dirty)' if prov.get('git_dirty') == 'true' else ''}, {prov.get('date', '')}, torch "
        f"{prov.get('version.torch', '?')}, Python {prov.get('version.python', '?')}. Ratios are throughput relative "
        "to BF16, measured side by side in this run.",
        "",
        "Statuses: passed = every check held on a GPU; rehearsed = every check held on the CPU of a machine without "
        "a GPU (the code ran; nothing about a GPU was measured); skipped = its stack or device is missing; failed = "
        "an error, a timeout or a check that did not hold.",
        "",
        "| section | status | wall s | summary |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r.get('status', status(r))} | {fmt(r.get('wall_s'), '.1f')} | "
            f"{summary_line(name, r).replace('|', '/')} |"
        )
    if targets:
        lines += ["", "| target | ratio | required | met |", "|---|---|---|---|"]
        for name, v in targets.items():
            lines.append(f"| {name} | {v['ratio']:.2f}x | {v['target']}x | {'yes' if v['met'] else 'NO'} |")
    for name, value in results.items():
        lines += ["", f"## {name}", ""]
        tables = section_tables(name, value) if "error" not in value and "skipped" not in value else []
        if tables:
            lines += tables + [""]
        brief = {k: v for k, v in value.items() if k not in ("gpu", "cpu", "comparison", "table", "cases", "apis")}
        lines += ["```json", json.dumps(brief, indent=1, default=str)[:4000], "```"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, results: dict[str, Any], device: str, done: bool) -> None:
    """gpu_check.json and gpu_check.md from the results so far (``done``: every section ran)."""
    from fp8rl.tracking.provenance import provenance

    results = scrub(results)
    targets = verdicts(results)
    overall = (
        verdict(results)
        if done
        else {**verdict(results), "verdict": "incomplete (the check is still running or was stopped)"}
    )
    prov = scrub(provenance())
    out.mkdir(parents=True, exist_ok=True)
    payload = {"device": device, "complete": done, "verdict": overall, "results": results, "targets": targets}
    write_json(out / "gpu_check.json", payload)
    try:
        text = markdown(results, targets, prov, device, overall)
    except Exception as err:  # noqa: BLE001 - the JSON is written; a rendering bug must not stop the check
        text = f"# GPU check\n\n**Verdict: {overall['verdict']}.** The Markdown report failed to render ({err!r}): "
        text += "see gpu_check.json.\n"
    (out / "gpu_check.md").write_text(text)


def device_name() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device (CPU rehearsal)"
    cap = ".".join(map(str, torch.cuda.get_device_capability()))
    return f"{torch.cuda.get_device_name()} (compute capability {cap})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--sections", default=",".join(SECTION_NAMES))
    parser.add_argument("--budget-s", type=float, default=500, help="wall time for all sections together")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rl-steps", type=int, default=4)
    parser.add_argument("--scrub-logs", action="store_true", help="only replace local paths in --out's logs")
    parser.add_argument("--run-section", help=argparse.SUPPRESS)  # internal: one section in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.scrub_logs:
        print(f"scrubbed {len(scrub_files(args.out))} log(s) in {args.out}")
        return 0
    if args.run_section:
        args.result.write_text(json.dumps(run_one(args.run_section, args), default=str))
        return 0
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_name()
    if not torch.cuda.is_available():
        print("no CUDA device: a CPU rehearsal (the GPU parts skip; the verdict cannot be a pass)", file=sys.stderr)
    names = [n for n in args.sections.split(",") if n]
    runners = driver_runners(args, args.out, deadline)
    results = run_sections(names, runners, lambda r: write_report(args.out, r, device, done=False))
    write_report(args.out, results, device, done=True)
    overall = verdict(results)
    print(f"verdict: {overall['verdict']}; wrote {args.out / 'gpu_check.md'}")
    return EXIT_CODES[overall["verdict"]]


if __name__ == "__main__":
    raise SystemExit(main())
