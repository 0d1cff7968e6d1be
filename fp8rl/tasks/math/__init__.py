"""Math reasoning with verifier rewards (the paper's workload): data sets, math-verify reward, task, mini assets.

Importing this package registers the ``"math"`` task; it imports neither ``datasets`` nor ``transformers``
(those load when problems or a tokenizer are loaded).
"""

from fp8rl.tasks.math.reward import extract_final_answer, math_reward, math_rewards, shutdown_verifier_pool
from fp8rl.tasks.math.sources import DATASETS, DatasetError, DataSource, load_problems
from fp8rl.tasks.math.task import HFTokenizer, MathTask, build_math_task, check_math_config

__all__ = [
    "DATASETS",
    "DataSource",
    "DatasetError",
    "HFTokenizer",
    "MathTask",
    "build_math_task",
    "check_math_config",
    "extract_final_answer",
    "load_problems",
    "math_reward",
    "math_rewards",
    "shutdown_verifier_pool",
    "write_mini_assets",
]


def __getattr__(name: str):
    """``write_mini_assets`` on first use, so that ``python -m fp8rl.tasks.math.mini`` runs the module only once."""
    if name == "write_mini_assets":
        from fp8rl.tasks.math.mini import write_mini_assets

        return write_mini_assets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
