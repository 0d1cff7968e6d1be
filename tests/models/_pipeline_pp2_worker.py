"""Worker for test_pipeline.py: run with torchrun --nproc-per-node 2 (gloo, CPU). Exits non-zero on a failed check."""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from types import SimpleNamespace


def main() -> None:
    import torch
    import torch.distributed as dist

    from fp8rl.models.runtime import init_megatron

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    init_megatron(1, 2, seed=0)

    from fp8rl.models import pipeline as pp
    from fp8rl.models.config import ModelConfig
    from fp8rl.models.gpt import build_gpt_model
    from fp8rl.models.logprobs import token_logprobs_and_entropy

    def worst(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    gen = torch.Generator().manual_seed(7)

    def microbatch(rows, prompt, response):
        ids = torch.zeros(rows, prompt + response, dtype=torch.long)
        am = torch.zeros_like(ids)
        for r in range(rows):
            p = int(torch.randint(2, prompt + 1, (1,), generator=gen))
            q = int(torch.randint(1, response + 1, (1,), generator=gen))
            ids[r, prompt - p : prompt + q] = torch.randint(1, 100, (p + q,), generator=gen)
            am[r, prompt - p : prompt + q] = 1
        return SimpleNamespace(
            input_ids=ids,
            attention_mask=am,
            response_len=response,
            loss_mask=am[:, -response:].float(),
            adv=torch.randn(rows, generator=gen),
        )

    mbs = [microbatch(2, 5, 6), microbatch(3, 4, 9), microbatch(1, 9, 3)]  # variable (b, s) per micro-batch
    n_total = float(sum(mb.loss_mask.sum() for mb in mbs))
    temp, vocab = 0.9, 100

    def token_loss(mb, logp, entropy):
        ratio = torch.exp(logp - mb.old_logp)
        adv = mb.adv[:, None]
        clipped = torch.where(
            (adv > 0) & (ratio > 1.2) | (adv < 0) & (ratio < 0.8), ratio.detach().clamp(0.8, 1.2), ratio
        )
        return (-adv * clipped - 0.01 * entropy) * mb.loss_mask, {}

    checks = []
    for tied in (False, True):
        cfg = ModelConfig(
            name="pp_test",
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=128,
            vocab_size=128,
            max_seq_len=32,
            rotary_base=10_000.0,
            tie_embeddings=tied,
        )
        ref = build_gpt_model(cfg, 1234)
        stage = pp.build_gpt_stage(cfg, 1234)
        offset, _ = pp.stage_layer_range(stage.config)
        ref_sd = ref.state_dict()
        src = {
            k: ("embedding.word_embeddings.weight" if tied and k == "output_layer.weight" else pp.global_key(k, offset))
            for k in stage.state_dict()
        }
        checks.append(
            (
                f"tied={tied} weights",
                worst(
                    max(
                        (v - ref_sd[src[k]]).abs().max().item()
                        for k, v in stage.state_dict().items()
                        if torch.is_tensor(v)
                    )
                ),
                0.0,
            )
        )
        precisions = {"fp32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
        for name, precision in precisions.items():
            with torch.no_grad(), precision():
                ref_lp = [
                    token_logprobs_and_entropy(ref, mb.input_ids, mb.attention_mask, mb.response_len, temp, vocab)
                    for mb in mbs
                ]
            for mb, (lp, _) in zip(mbs, ref_lp, strict=True):
                mb.old_logp = lp + 0.2 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
            got = pp.pipeline_logprobs(stage, mbs, temperature=temp, vocab_size=vocab, precision=precision)
            checks.append(
                (
                    f"tied={tied} {name} logp",
                    worst(max((g[0] - r[0]).abs().max().item() for g, r in zip(got, ref_lp, strict=True))),
                    1e-6,
                )
            )
            checks.append(
                (
                    f"tied={tied} {name} entropy",
                    worst(max((g[1] - r[1]).abs().max().item() for g, r in zip(got, ref_lp, strict=True))),
                    1e-6,
                )
            )
            ref.zero_grad(set_to_none=True)
            total = 0.0
            for mb in mbs:
                with precision():
                    lp, ent = token_logprobs_and_entropy(
                        ref, mb.input_ids, mb.attention_mask, mb.response_len, temp, vocab
                    )
                total = total + token_loss(mb, lp, ent)[0].sum() / n_total
            total.backward()
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            stage.zero_grad(set_to_none=True)
            loss, _ = pp.pipeline_loss_backward(
                stage, mbs, token_loss, temperature=temp, vocab_size=vocab, precision=precision
            )
            pp.sync_tied_embedding_grads(stage)
            checks.append((f"tied={tied} {name} loss", worst(abs(loss - float(total))), 1e-6))
            checks.append(
                (
                    f"tied={tied} {name} grads",
                    worst(max((p.grad - ref_grads[src[n]]).abs().max().item() for n, p in stage.named_parameters())),
                    1e-6,
                )
            )

    failed = [c for c in checks if not c[1] <= c[2]]
    if dist.get_rank() == 0:
        for name, value, tol in checks:
            print(f"{name}: max|d| {value:.3g} (tol {tol:g})", flush=True)
        print("PIPELINE WORKER " + ("FAILED" if failed else "OK"), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
