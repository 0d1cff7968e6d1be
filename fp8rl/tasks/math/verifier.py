"""math-verify equivalence of a final answer and a ground truth, and the verifier worker process that runs it.

Standalone on purpose: it imports only the standard library and ``math_verify``, so that
``python -P verifier.py FD`` starts a worker without importing fp8rl (torch) or the caller's main module.
The worker reads ``(index, answer, ground_truth, op_timeout_s)`` from the connection on file descriptor FD and
answers ``(index, score)``; it announces itself with ``"ready"`` after a warm-up verification and exits when the
connection closes or it receives None.
"""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Connection

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

READY = "ready"
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _last_dollar_segment(text: str) -> str | None:
    """Content of the last ``$...$`` pair in ``text``, or None."""
    parts = text.split("$")
    inner = [part for part in parts[1:-1:2] if part.strip()] if len(parts) >= 3 else []
    return inner[-1] if inner else None


def clean_answer(answer: str) -> str:
    """Strip markdown emphasis, a trailing period and outer math delimiters; keep the last ``$...$`` of prose
    ("The final answer is $5$. I hope it is correct." -> "5")."""
    answer = answer.strip().strip("*").strip()
    for _ in range(2):  # e.g. "$5$." -> "$5$" -> "5"
        answer = answer.removesuffix(".").strip()
        for opening, closing in _WRAPPERS:
            if len(answer) <= len(opening) + len(closing):
                continue
            inner = answer[len(opening) : -len(closing)]
            if answer.startswith(opening) and answer.endswith(closing) and opening not in inner:
                answer = inner.strip()
    segment = _last_dollar_segment(answer)
    return segment.strip() if segment is not None else answer


def verify_answer(answer: str, ground_truth: str, op_timeout_s: int | None = 1) -> float:
    """1.0 iff math-verify finds ``answer`` equal to ``ground_truth`` (both bare answers, no prose), else 0.0.

    Both are cleaned (:func:`clean_answer`), wrapped in ``\\boxed{}`` and parsed (LaTeX first, then plain
    expressions); ``verify(gold, pred)`` decides. ``op_timeout_s`` is math-verify's per-operation
    ``signal.alarm`` (whole seconds; works only in a main thread; None disables it and leaves this unbounded).
    """
    alarm = op_timeout_s if op_timeout_s is not None else 0
    gold = parse(f"\\boxed{{{clean_answer(ground_truth)}}}", _EXTRACTION, parsing_timeout=alarm)
    if not gold:
        return 0.0
    pred = parse(f"\\boxed{{{clean_answer(answer)}}}", _EXTRACTION, parsing_timeout=alarm)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=alarm) else 0.0


def serve(conn: Connection) -> None:
    """Worker loop: warm up, announce readiness, then score tasks until None or the connection closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are expected; the parent counts kills
    verify_answer("1", "1")  # imports sympy's lazy parts before the first timed task
    conn.send(READY)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, answer, ground_truth, op_timeout_s = task
        try:
            score = verify_answer(answer, ground_truth, op_timeout_s)
        except Exception:  # noqa: BLE001 - a verifier crash (RecursionError, MemoryError, ...) is a wrong answer
            score = 0.0
        conn.send((index, score))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
