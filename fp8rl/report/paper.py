"""The paper's reported numbers (../shared/PAPER.md, "Headline results": approximate, from one summary).

Keyed by our experiment and arm names so that a generated table can set them beside ours. They are the
paper's benchmark scores (GRPO: average over math benchmarks; DAPO: AIME24 Avg@32; ablation: average
score), not comparable in absolute value to our task accuracy: compare orderings and gaps to BF16.
"""

from __future__ import annotations

PAPER_SCORES: dict[str, dict[str, float]] = {
    "grpo_granularity": {
        "bf16": 57.6,
        "fp8_tensorwise": 46.1,
        "fp8_rowwise": 47.0,
        "fp8_blockwise": 54.1,
        "cc_rowwise": 58.6,  # the summary gives one Calibrated Clipping score; the K ablation is rowwise
    },
    "dapo_table": {"bf16": 50.9, "fp8_blockwise": 41.6, "cc_blockwise": 47.4},
    "ablation_recal_interval": {"10": 58.31, "20": 56.51, "40": 57.91},
}
PAPER_METRIC = {
    "grpo_granularity": "average score, Qwen3-8B-Base (GRPO)",
    "dapo_table": "AIME24 Avg@32, Qwen3-14B-Base (DAPO)",
    "ablation_recal_interval": "average score, rowwise, K = 10/20/40 steps",
}
