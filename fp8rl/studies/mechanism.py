"""The one-step study of the failure mechanism (``make mechanism``).

At fixed checkpoints of a BF16 GRPO run (early: the warm start; late: after the tiny scale's 40 BF16 RL
steps) and for each precision (BF16 and every FP8 recipe), one PPO mini-batch update is taken at each
learning rate of a sweep that crosses the FP8 log-ratio noise floor, and the ratios the *next*
mini-batch would see are measured (update on half of a GRPO batch, measure on the other half, as with
``algo.num_minibatches=2``):

- full pipeline (``mode=full``): old and new log-probs in the recipe (FP8 forward and backward), beside
  the BF16 shadow of the same weights (the ratio BF16 would have computed); the ``fp32`` row does the same
  without autocast, so BF16's own noise floor shows against it;
- mismatched (``mode=mismatch``): old log-probs from an FP8 rollout engine (the recipe), new ones from a
  BF16 trainer after a BF16 update, beside the all-BF16 ratio.

Per cell: the spread of the log-ratio (FP8 and BF16 shadow), the raw log-prob noise, ``clip/low_neg``
(FP8 and BF16), the over-/under-clip rates of negative-advantage tokens against BF16, p = positive /
negative contribution, each also after Calibrated Clipping, and the overlap (precision, recall) of the
tokens FP8 clips with the tokens BF16 clips. Tokens of ``batches`` GRPO batches are pooled; Calibrated
Clipping is measured out of sample: calibrated on one batch's tokens, evaluated on another's (and the other
way round; the mean). Cells are read by the measured BF16 log-ratio spread, not by lr: a fresh AdamW's first
step is sign descent (every parameter moves by about lr), so its lr does not map onto an RL run's, whose
``clip/shadow_ref_log_ratio_std`` locates it in these tables. Every cell is one MLflow run (experiment
``mechanism-tiny``) with its ratio histograms split by advantage sign as an artifact; ``fp8rl.report`` builds
the table and figures from those runs.

Variants: the model as trained, and the same weights with injected activation outlier channels
(`fp8rl.models.outliers`, function-preserving), to test the granularity ordering on a model that has
outliers. Finished cells are found in MLflow and skipped, so a re-run only fills gaps.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8rl import algos
from fp8rl.compose import compose_config
from fp8rl.config import RunConfig, with_overrides
from fp8rl.job import build_trainer, run_job
from fp8rl.models.outliers import inject_activation_outliers, remove_activation_outliers
from fp8rl.quant import get_recipe
from fp8rl.trainer import checkpoint as ckpt
from fp8rl.trainer.loop import RLTrainer

RECIPES = ("bf16", "fp32", "tensorwise", "rowwise", "blockwise", "mxfp8")
REFERENCE_RECIPES = ("bf16", "fp32")  # not FP8: no mismatched cells, no noise scan
HIST_EDGES = torch.linspace(-0.3, 0.3, 61)


@dataclass
class MechanismConfig:
    """What the study sweeps; defaults are the committed results/tiny/ run."""

    lrs: tuple[float, ...] = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4)
    recipes: tuple[str, ...] = RECIPES
    checkpoints: tuple[str, ...] = ("early", "late")
    # (channels, scale); (0, 1) = as trained. E4M3 absorbs outliers up to ~1e4 x (its dynamic range; see the
    # noise scan), so the variant uses 32768 x, the regime of LLMs' massive activations.
    outliers: tuple[tuple[int, float], ...] = ((0, 1.0), (4, 32768.0))
    noise_scan: tuple[float, ...] = (1.0, 32.0, 1024.0, 8192.0, 32768.0, 131072.0)  # outlier scales, 4 channels
    outlier_method: str = "input_channel_scale"  # fp8rl.models.outliers (part of the key: results depend on it)
    cc_fit: str = "other_batch"  # Calibrated Clipping calibrated on one batch, measured on another (part of the key)
    batches: int = 2  # GRPO batches pooled per cell
    prompts: int = 64  # prompts per batch (x group size 8 = 512 sequences; update on 256, measure on 256)
    late_steps: int = 40  # BF16 RL steps before the "late" checkpoint (the tiny scale's run length)
    seed: int = 0
    experiment: str = "mechanism-tiny"
    out_dir: str = "outputs/mechanism"
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db

    def key(self) -> str:
        """Hash of what changes results (not the output locations)."""
        fields = {
            k: v for k, v in dataclasses.asdict(self).items() if k not in ("experiment", "out_dir", "tracking_uri")
        }
        fields.pop("lrs"), fields.pop("recipes"), fields.pop("checkpoints"), fields.pop("outliers")
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Cell:
    variant: str  # "none" or "outliers4x32"
    checkpoint: str  # "early" / "late"
    mode: str  # "full" / "mismatch"
    recipe: str
    lr: float

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.checkpoint}-{self.mode}-{self.recipe}-lr{self.lr:g}"


@dataclass
class Tokens:
    """Per-token tensors of one cell, one entry per batch; ``cat`` pools (some of) them, shaped (1, N) so the
    (batch, len) metric functions apply."""

    ratio: list[torch.Tensor] = field(default_factory=list)
    ratio_ref: list[torch.Tensor] = field(default_factory=list)
    adv: list[torch.Tensor] = field(default_factory=list)
    noise: list[torch.Tensor] = field(default_factory=list)

    def add(self, ratio, ratio_ref, adv, noise, mask) -> None:
        keep = mask.bool()
        self.ratio.append(ratio[keep])
        self.ratio_ref.append(ratio_ref[keep])
        self.adv.append(adv[:, None].expand_as(ratio)[keep])
        self.noise.append(noise[keep])

    def cat(self, parts: list[int] | None = None) -> tuple[torch.Tensor, ...]:
        """(ratio, ratio_ref, adv, noise) of the batches `parts` (default all), each (1, N)."""
        pick = range(len(self.adv)) if parts is None else parts
        fields = (self.ratio, self.ratio_ref, self.adv, self.noise)
        return tuple(torch.cat([x[i] for i in pick])[None, :] for x in fields)


def base_config(mcfg: MechanismConfig, out_dir: Path) -> RunConfig:
    """The tiny scale's BF16 GRPO run (TIS as in every table arm)."""
    cfg = compose_config(["scale=tiny", "precision=bf16", "clipping=tis", f"trainer.seed={mcfg.seed}"])
    return with_overrides(cfg, {"trainer.out_dir": str(out_dir), "tracking.tracking_uri": mcfg.tracking_uri})


def late_checkpoint(mcfg: MechanismConfig) -> dict[str, torch.Tensor]:
    """Model weights after `late_steps` BF16 RL steps (trained once; resumed or reused from its folder)."""
    cfg = base_config(mcfg, Path(mcfg.out_dir) / f"bf16-run-{mcfg.key()}")
    tags = {"fp8rl.mechanism": "late-checkpoint-run", "fp8rl.mechanism_key": mcfg.key()}
    cfg = with_overrides(
        cfg,
        {
            "trainer.steps": mcfg.late_steps,
            "trainer.keep_checkpoints": 1,
            "tracking.experiment": mcfg.experiment,
            "tracking.run_name": f"bf16-rl-{mcfg.late_steps}-steps",
            "tracking.tags": tags,
        },
    )
    found = ckpt.latest_good_checkpoint(cfg.trainer.out_dir)
    if found is None or found[1]["step"] < mcfg.late_steps:
        run_job(cfg)
        found = ckpt.latest_good_checkpoint(cfg.trainer.out_dir)
    return found[1]["model"]


def study_trainer(mcfg: MechanismConfig) -> RLTrainer:
    cfg = base_config(mcfg, Path(tempfile.mkdtemp(prefix="mechanism-")))
    return build_trainer(with_overrides(cfg, {"algo.prompts_per_step": mcfg.prompts, "tracking.enabled": False}))


def recipe_of(name: str):
    return None if name in REFERENCE_RECIPES else get_recipe(name)


def compute_of(name: str) -> str:
    """The non-FP8 precision of a row: fp32 for the fp32 row, BF16 autocast for every other."""
    return "fp32" if name == "fp32" else "bf16"


def sample_batches(trainer: RLTrainer, mcfg: MechanismConfig) -> list[dict[str, Any]]:
    """GRPO batches from the BF16 engine: (update rows, measure rows, advantages), fixed per seed."""
    out = []
    for b in range(mcfg.batches):
        problems, batch = trainer.sampler.rollout(step=10_000 + b)
        adv = trainer.sampler.score(problems, batch).adv
        update_rows, measure_rows = trainer.minibatches(len(problems), epoch_seed=10_000 + b)
        out.append({"batch": batch, "adv": adv, "update": update_rows, "measure": measure_rows})
    return out


def old_logprobs(trainer: RLTrainer, batches: list[dict], recipes: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """Log-probs of the measured rows at the checkpoint, per recipe (the FP8 rollout engine / old policy)."""
    return [
        {
            r: trainer.logprobs(b["batch"].select(b["measure"]), recipe_of(r), grad=False, compute=compute_of(r))[0]
            for r in recipes
        }
        for b in batches
    ]


def one_update(
    trainer: RLTrainer, state: dict, b: dict, recipe, lr: float, eps: tuple[float, float], compute: str = "bf16"
) -> None:
    """Restore `state`, take one AdamW step of the PPO-clip loss on the update rows in `recipe`."""
    trainer.model.load_state_dict(state)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=lr, weight_decay=0.0)
    mb = b["batch"].select(b["update"])
    adv = b["adv"][b["update"]]
    logp, _ = trainer.logprobs(mb, recipe, grad=True, compute=compute)
    tokens = algos.TokenBatch(logp.detach(), adv, mb.response_mask)  # first mini-batch: old = current, ratio 1
    loss = algos.get_policy_loss("ppo_clip")(logp, tokens, (1 - eps[0], 1 + eps[1]))[0]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def cell_metrics(tokens: Tokens, eps: tuple[float, float]) -> dict[str, float]:
    ratio, ratio_ref, adv, noise = tokens.cat()
    mask = torch.ones_like(ratio, dtype=torch.bool)
    low, high = 1 - eps[0], 1 + eps[1]
    m: dict[str, Any] = {
        "mech/log_ratio_std": torch.log(ratio).std(),
        "mech/ref_log_ratio_std": torch.log(ratio_ref).std(),
        "mech/logp_abs_noise": noise.abs().mean(),
        "mech/tokens": float(ratio.numel()),
        "mech/neg_tokens": float((adv < 0).sum()),
    }
    m.update(algos.clip_fraction_metrics(ratio, adv, mask, low, high))
    m.update(algos.overclip_metrics(ratio_ref, ratio, adv, mask, low, high, low, high))
    m.update(algos.clip_overlap_metrics(ratio_ref, ratio, adv, mask, low, low))
    m.update(cc_out_of_sample(tokens, eps))
    return {k: float(v) for k, v in algos.metrics_to_floats(m).items()}


def cc_out_of_sample(tokens: Tokens, eps: tuple[float, float]) -> dict[str, Any]:
    """Calibrated Clipping calibrated on one batch's tokens and measured on another's, for each ordered pair of
    (consecutive) batches; the mean over the pairs (``cc/*``), with the held-out negative tokens counted."""
    n = len(tokens.adv)
    if n < 2:
        raise ValueError("out-of-sample calibration needs at least 2 batches (MechanismConfig.batches)")
    low_std, high_std = 1 - eps[0], 1 + eps[1]
    results = []
    for fit in range(n):
        held = (fit + 1) % n
        fit_ratio, fit_ref, fit_adv, _ = tokens.cat([fit])
        ratio, ratio_ref, adv, _ = tokens.cat([held])
        cal = algos.calibrate(fit_ref, fit_ratio, fit_adv, torch.ones_like(fit_ratio, dtype=torch.bool), *eps)
        low, high = cal.bounds
        mask = torch.ones_like(ratio, dtype=torch.bool)
        after = {
            **algos.clip_fraction_metrics(ratio, adv, mask, low, high),
            **algos.overclip_metrics(ratio_ref, ratio, adv, mask, low, high, low_std, high_std),
            **algos.clip_overlap_metrics(ratio_ref, ratio, adv, mask, low, low_std),
        }
        row = {f"cc/{k.split('/', 1)[1]}": float(v) for k, v in after.items() if not k.startswith("clip/ref")}
        row.update({"cc/low": low, "cc/high": high, "cc/status": float(int(cal.status))})
        row["cc/neg_tokens"] = float((adv < 0).sum())
        results.append(row)
    out = {k: sum(r[k] for r in results) / len(results) for k in results[0] if k != "cc/neg_tokens"}
    out["cc/neg_tokens"] = sum(r["cc/neg_tokens"] for r in results)
    return out


def histograms(tokens: Tokens) -> dict[str, Any]:
    """Log-ratio histograms (FP8 and BF16 shadow) split by advantage sign, on fixed edges."""
    ratio, ratio_ref, adv, _ = tokens.cat()
    out: dict[str, Any] = {"edges": HIST_EDGES.tolist()}
    for sign, keep in (("neg", adv < 0), ("pos", adv > 0)):
        for name, r in (("fp8", ratio), ("bf16", ratio_ref)):
            values = torch.log(r[keep]).clamp(HIST_EDGES[0], HIST_EDGES[-1])
            out[f"{name}_{sign}"] = torch.histogram(values.float(), HIST_EDGES).hist.tolist()
    return out


def measure_cell(trainer, state, batches, olds, cell: Cell, eps, bf16_updates: dict) -> Tokens:
    """Pooled tokens of one cell. `bf16_updates` caches the BF16-updated log-probs per (lr, batch): the
    mismatched cells and the BF16 cell share the same BF16 update."""
    tokens = Tokens()
    train_recipe = recipe_of(cell.recipe) if cell.mode == "full" else None
    compute = compute_of(cell.recipe) if cell.mode == "full" else "bf16"
    shares_bf16_update = train_recipe is None and compute == "bf16"
    for i, (b, old) in enumerate(zip(batches, olds, strict=True)):
        mb = b["batch"].select(b["measure"])
        if shares_bf16_update and (cell.lr, i) in bf16_updates:
            new_ref = bf16_updates[(cell.lr, i)]
        else:
            one_update(trainer, state, b, train_recipe, cell.lr, eps, compute)
            new_ref, _ = trainer.logprobs(mb, None, grad=False)
            if shares_bf16_update:
                bf16_updates[(cell.lr, i)] = new_ref
        if shares_bf16_update:
            new = new_ref
        else:
            new = trainer.logprobs(mb, train_recipe, grad=False, compute=compute)[0]
        ratio = torch.exp(new - old[cell.recipe])
        ratio_ref = torch.exp(new_ref - old["bf16"])
        tokens.add(ratio, ratio_ref, b["adv"][b["measure"]], old[cell.recipe] - old["bf16"], mb.response_mask)
    return tokens


def noise_scan_cells(mcfg: MechanismConfig) -> list[Cell]:
    """Raw log-prob noise per recipe vs the injected outlier scale (forwards only; ``lr`` unused)."""
    return [
        Cell(variant_name(4, s) if s > 1 else "none", ck, "noise_scan", "all", 0.0)
        for ck in mcfg.checkpoints
        for s in mcfg.noise_scan
    ]


def scan_noise(trainer: RLTrainer, state: dict, batches: list[dict], mcfg: MechanismConfig, scale: float) -> dict:
    """Mean |logp_recipe - logp_BF16| over the sampled response tokens, per FP8 recipe, at outlier `scale`."""
    trainer.model.load_state_dict(state)
    remove_activation_outliers(trainer.model)
    if scale > 1:
        inject_activation_outliers(trainer.model, 4, scale, seed=mcfg.seed)
    olds = old_logprobs(trainer, batches, mcfg.recipes)
    remove_activation_outliers(trainer.model)
    out = {}
    for recipe in mcfg.recipes:
        if recipe in REFERENCE_RECIPES:
            continue
        diffs = [
            (o[recipe] - o["bf16"])[b["batch"].select(b["measure"]).response_mask.bool()]
            for o, b in zip(olds, batches, strict=True)
        ]
        out[f"noise/{recipe}"] = float(torch.cat(diffs).abs().mean())
    out["mech/outlier_scale"] = scale
    return out


def cells_for(mcfg: MechanismConfig, variant: str, checkpoint: str) -> list[Cell]:
    full = [Cell(variant, checkpoint, "full", r, lr) for r in mcfg.recipes for lr in mcfg.lrs]
    fp8 = [r for r in mcfg.recipes if r not in REFERENCE_RECIPES]
    mismatch = [Cell(variant, checkpoint, "mismatch", r, lr) for r in fp8 for lr in mcfg.lrs]
    return full + mismatch


def variant_name(channels: int, scale: float) -> str:
    return "none" if channels == 0 else f"outliers{channels}x{scale:g}"


def run_study(mcfg: MechanismConfig, log=print) -> list[str]:
    """Run every cell not yet FINISHED in MLflow; returns the run ids of all cells."""
    from fp8rl.tracking import store as runs
    from fp8rl.tracking.provenance import provenance

    uri = runs.absolute_tracking_uri(mcfg.tracking_uri)
    client = runs.client(uri)
    exp_id = runs.experiment_id(client, mcfg.experiment, create=True)
    done = _finished_cells(client, exp_id, mcfg.key())
    plan = [
        (ch, sc, ck, cell)
        for ch, sc in mcfg.outliers
        for ck in mcfg.checkpoints
        for cell in cells_for(mcfg, variant_name(ch, sc), ck)
    ]
    plan += [(0, 1.0, cell.checkpoint, cell) for cell in noise_scan_cells(mcfg)]
    todo = [p for p in plan if p[3].name not in done]
    log(f"mechanism: {len(plan)} cells, {len(plan) - len(todo)} finished in MLflow ({uri}), {len(todo)} to run")
    if not todo:
        return [done[p[3].name] for p in plan]
    trainer = study_trainer(mcfg)
    warm = copy.deepcopy(trainer.model.state_dict())
    late = late_checkpoint(mcfg) if any(p[2] == "late" for p in todo) else None
    eps = (trainer.cfg.algo.eps_low, trainer.cfg.algo.eps_high)
    prov, started, finished = provenance(), time.monotonic(), 0
    for (channels, scale, checkpoint), cells in _grouped(todo).items():
        trainer.model.load_state_dict(warm if checkpoint == "early" else late)
        remove_activation_outliers(trainer.model)
        if channels:
            inject_activation_outliers(trainer.model, channels, scale, seed=mcfg.seed)
        state = copy.deepcopy(trainer.model.state_dict())
        batches = sample_batches(trainer, mcfg)
        olds = old_logprobs(trainer, batches, mcfg.recipes)
        bf16_updates: dict = {}
        for cell in cells:
            if cell.mode == "noise_scan":
                scale = float(cell.variant.split("x")[-1]) if cell.variant != "none" else 1.0
                done[cell.name] = _log_cell(
                    client, exp_id, cell, mcfg, scan_noise(trainer, state, batches, mcfg, scale), None, prov
                )
            else:
                tokens = measure_cell(trainer, state, batches, olds, cell, eps, bf16_updates)
                metrics, hist = cell_metrics(tokens, eps), histograms(tokens)
                done[cell.name] = _log_cell(client, exp_id, cell, mcfg, metrics, hist, prov)
            finished += 1
            elapsed = time.monotonic() - started
            eta = elapsed / finished * (len(todo) - finished)
            log(f"[{finished}/{len(todo)}] {cell.name} done; elapsed {elapsed:.0f}s, ETA {eta:.0f}s")
    getattr(trainer.engine, "close", lambda: None)()  # the rollout engine's resources (vLLM), as the job does
    return [done[p[3].name] for p in plan]


def _grouped(todo: list[tuple]) -> dict[tuple, list[Cell]]:
    groups: dict[tuple, list[Cell]] = {}
    for channels, scale, checkpoint, cell in todo:
        groups.setdefault((channels, scale, checkpoint), []).append(cell)
    return groups


def _finished_cells(client, exp_id: str, key: str) -> dict[str, str]:
    from fp8rl.tracking import store as runs

    found = runs.search(client, exp_id, f"tags.`fp8rl.mechanism_key` = '{key}' and attributes.status = 'FINISHED'")
    return {r.data.tags.get("fp8rl.mechanism_cell", ""): r.info.run_id for r in found}


def _log_cell(client, exp_id, cell: Cell, mcfg: MechanismConfig, metrics, hist, prov) -> str:
    from mlflow.entities import Metric, Param, RunTag

    tags = {
        "mlflow.runName": cell.name,
        "fp8rl.mechanism": "cell",
        "fp8rl.mechanism_cell": cell.name,
        "fp8rl.mechanism_key": mcfg.key(),
        **prov,
    }
    run_id = client.create_run(exp_id, tags=tags, run_name=cell.name).info.run_id
    params = {
        **dataclasses.asdict(cell),
        "batches": mcfg.batches,
        "prompts": mcfg.prompts,
        "seed": mcfg.seed,
        "late_steps": mcfg.late_steps,
    }
    now = int(time.time() * 1000)
    finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
    client.log_batch(
        run_id,
        metrics=[Metric(k, v, now, 0) for k, v in finite.items()],
        params=[Param(k, str(v)) for k, v in params.items()],
        tags=[RunTag(k, str(v)) for k, v in {"mode": cell.mode, "recipe": cell.recipe}.items()],
    )
    if hist is not None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ratio_histograms.json"
            path.write_text(json.dumps(hist))
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, "FINISHED")
    return run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", default=None, help="comma-separated learning rates (default: the committed sweep)")
    parser.add_argument("--recipes", default=None, help=f"comma-separated, from {RECIPES}")
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--no-outliers", action="store_true", help="skip the outlier-injection variant")
    parser.add_argument("--experiment", default=None, help="MLflow experiment (default mechanism-tiny)")
    args = parser.parse_args(argv)
    mcfg = MechanismConfig()
    if args.lrs:
        mcfg.lrs = tuple(float(x) for x in args.lrs.split(","))
    if args.recipes:
        unknown = set(args.recipes.split(",")) - set(RECIPES)
        if unknown:
            parser.error(f"unknown recipes {sorted(unknown)}; choose from {RECIPES}")
        mcfg.recipes = tuple(args.recipes.split(","))
        if "bf16" not in mcfg.recipes:
            mcfg.recipes = ("bf16", *mcfg.recipes)  # the BF16 old log-probs are the reference
    for name in ("batches", "prompts", "experiment"):
        if getattr(args, name) is not None:
            setattr(mcfg, name, getattr(args, name))
    if args.no_outliers:
        mcfg.outliers = ((0, 1.0),)
        mcfg.noise_scan = ()
    run_study(mcfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["MechanismConfig", "run_study"]
