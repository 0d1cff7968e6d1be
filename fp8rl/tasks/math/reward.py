"""Verifier reward for math answers: answer extraction, math-verify equivalence, and a time-bounded worker pool.

A response earns 1.0 when its final answer is mathematically equal to the ground truth, else 0.0.

Extraction (cheap, pure regex, done in the calling process): the final answer is the content of the last
``\\boxed{...}`` (balanced braces, so ``\\boxed{\\frac{1}{2}}`` works) or of the last ``Answer: ...`` line (the
form DAPO-Math-17K's prompt asks for), whichever starts later in the text. Outer ``$...$`` / ``\\(...\\)`` /
``\\[...\\]`` wrappers, markdown ``**`` and a trailing period are dropped; a line such as "The final answer is
$5$. I hope it is correct." keeps its last ``$...$`` segment. No box and no ``Answer:`` line: no answer, 0.0
(no guessing from the last number in the text).

Equivalence: math-verify 0.9.0 (``math_verify.parse`` then ``math_verify.verify(gold, pred)``), the extracted
answer and the ground truth each wrapped in ``\\boxed{}`` and parsed with ``LatexExtractionConfig`` (boxed first)
and ``ExprExtractionConfig``. It accepts ``\\frac{1}{2}`` = ``\\dfrac12`` = ``1/2`` = ``0.5``, ``\\sqrt{2}`` =
``2^{1/2}``, ``1,000`` = ``1000``, ``x=5`` = ``5``, units in ``\\text{}``, intervals, sets; floats compare after
rounding to 6 decimals (``0.333333`` = ``1/3``, ``0.33`` != ``1/3``); ``10\\%`` is not parsed (string match only).

Time bounds. math-verify bounds ``parse`` (``parsing_timeout``) and ``verify`` (``timeout_seconds``) with
``signal.alarm``: whole seconds, and only in the main thread of a process (elsewhere math-verify raises
ValueError), and an alarm only fires between Python bytecodes, so it cannot stop C code. A trainer calls the
reward from wherever it likes (threads included), so verification never runs in the caller: it runs in
:class:`VerifierPool` worker processes, each a single-threaded main thread where the alarms work (per-operation
alarm ``op_timeout_s``), and the parent enforces a hard wall-clock deadline per item by SIGKILLing a worker that
has not answered within ``timeout_s`` and starting a replacement; the item scores 0.0. Measured on this machine
(2 CPUs): ``2^{2^{2^{2^{2^{2^{2}}}}}}`` parses in 0.15 s and its comparison is stopped by math-verify's 2 s
alarm; with the alarms off the same comparison ran for over 15 s, which is what the hard kill is for.

Workers are fresh interpreters running :mod:`fp8rl.tasks.math.verifier` as a script (``python -P``): no fork of
a trainer's threads, no re-import of the caller's main module, no torch; a (re)start took 0.25-1.1 s here.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from fp8rl.tasks.math import verifier
from fp8rl.tasks.math.verifier import clean_answer

_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
STARTUP_TIMEOUT_S = 120.0  # a worker that cannot import math-verify in this long is a broken install


# ---------------------------------------------------------------------------------------------
# Extraction (in the calling process: regular expressions only)


def _closing_braces(text: str) -> dict[int, int]:
    """Offset of each closed ``{`` -> offset of its matching ``}``, in one pass (a stack): linear in the text,
    however many openings are never closed."""
    stack: list[int] = []
    closing: dict[int, int] = {}
    for match in re.finditer(r"[{}]", text):
        if match.group() == "{":
            stack.append(match.start())
        elif stack:
            closing[stack.pop()] = match.start()
    return closing


def last_boxed(text: str) -> tuple[int, str] | None:
    """(start offset, content) of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (balanced
    braces), or None."""
    openings = list(_BOX_OPENING.finditer(text))
    if not openings:
        return None
    closing = _closing_braces(text)
    for match in reversed(openings):
        brace = match.end() - 1
        if brace in closing:
            return match.start(), text[match.end() : closing[brace]]
    return None


def last_answer_line(text: str) -> tuple[int, str] | None:
    """(start offset, rest of the line) of the last non-empty ``Answer: ...`` in ``text``, or None."""
    for match in reversed(list(_ANSWER_LINE.finditer(text))):
        if match.group(1).strip():
            return match.start(), match.group(1)
    return None


def extract_final_answer(response: str) -> str | None:
    """The final answer of a response (see the module docstring), cleaned; None if there is none."""
    boxed, line = last_boxed(response), last_answer_line(response)
    candidates = [found for found in (boxed, line) if found is not None]
    if not candidates:
        return None
    answer = clean_answer(max(candidates)[1])  # the later one: "Answer: \boxed{5}" -> the box
    return answer or None


# ---------------------------------------------------------------------------------------------
# The pool


@dataclass
class _Worker:
    """One verifier process and what it is doing: not ready yet, idle (task None) or on ``task`` until
    ``deadline`` (time.monotonic())."""

    process: subprocess.Popen
    conn: Connection
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    task: int | None = None
    deadline: float = math.inf


def _op_timeout_for(timeout_s: float) -> int:
    """Per-operation alarm (whole seconds, >= 1) so that parse + parse + verify usually fit in ``timeout_s``."""
    return max(1, int(timeout_s // 3))


class VerifierPool:
    """``workers`` verifier processes with a hard per-item deadline: a worker that has not answered within
    ``timeout_s`` of receiving an item is killed (SIGKILL) and replaced, and the item scores 0.0.

    ``op_timeout_s``: math-verify's per-operation alarm inside the workers; "auto" derives it from each call's
    ``timeout_s`` (see :func:`_op_timeout_for`), None turns it off so that only the hard kill bounds the time.
    ``killed`` counts the workers killed so far. Not thread-safe by itself (:func:`math_rewards` locks).
    """

    def __init__(self, workers: int, op_timeout_s: int | None | str = "auto"):
        if workers < 1:
            raise ValueError(f"workers={workers}; use at least 1 verifier process")
        self.op_timeout_s = op_timeout_s
        self.killed = 0
        self._workers = [self._start_worker() for _ in range(workers)]

    @property
    def size(self) -> int:
        """Number of worker processes."""
        return len(self._workers)

    @staticmethod
    def _start_worker() -> _Worker:
        """A fresh interpreter running the verifier script, talking over a socket pair."""
        parent_end, child_end = socket.socketpair()
        script = Path(verifier.__file__)
        process = subprocess.Popen(
            [sys.executable, "-P", str(script), str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            stdin=subprocess.DEVNULL,
        )
        child_end.close()
        return _Worker(process=process, conn=Connection(parent_end.detach()))

    @staticmethod
    def _stop(worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait(timeout=10)
        worker.conn.close()

    def _replace(self, slot: int) -> None:
        self._stop(self._workers[slot])
        self._workers[slot] = self._start_worker()

    def score(self, pairs: Sequence[tuple[str, str]], timeout_s: float = 5.0) -> list[float]:
        """Scores of ``(answer, ground_truth)`` pairs (extracted answers, not whole responses), in order."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; use a positive number of seconds")
        op_timeout = _op_timeout_for(timeout_s) if self.op_timeout_s == "auto" else self.op_timeout_s
        self._replace_busy()
        results = [0.0] * len(pairs)
        queue = deque(range(len(pairs)))
        while queue or any(worker.task is not None for worker in self._workers):
            self._dispatch(queue, pairs, timeout_s, op_timeout)
            self._collect(results)
            self._kill_overdue()
        return results

    def _replace_busy(self) -> None:
        """Replace workers still busy with an item of an interrupted earlier call, so that no late answer of theirs
        is taken for an item of this call."""
        for slot, worker in enumerate(self._workers):
            if worker.task is not None:
                self._replace(slot)

    def _dispatch(
        self, queue: deque[int], pairs: Sequence[tuple[str, str]], timeout_s: float, op_timeout: int | None
    ) -> None:
        """Hand the next items to idle ready workers; a worker found dead is replaced and its item requeued."""
        for slot, worker in enumerate(self._workers):
            if not queue:
                return
            if worker.ready and worker.task is None:
                index = queue.popleft()
                try:
                    worker.conn.send((index, *pairs[index], op_timeout))
                except OSError:  # died while idle (e.g. the OOM killer): try the item again elsewhere
                    queue.appendleft(index)
                    self._replace(slot)
                    continue
                worker.task, worker.deadline = index, time.monotonic() + timeout_s

    def _collect(self, results: list[float]) -> None:
        """Wait until a worker answers, becomes ready, or the nearest deadline passes; record what arrived."""
        waiting = [worker for worker in self._workers if worker.task is not None or not worker.ready]
        deadlines = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT_S for w in waiting]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
        arrived = set(wait([worker.conn for worker in waiting], timeout=timeout))
        for slot, worker in enumerate(self._workers):
            if worker.conn in arrived:
                self._receive(slot, worker, results)

    def _receive(self, slot: int, worker: _Worker, results: list[float]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the worker died: its item (if any) keeps 0.0
            if not worker.ready:
                raise RuntimeError(
                    f"a math verifier process exited during startup (exit code {worker.process.poll()}); "
                    "check that `python -c 'import math_verify'` works in this environment"
                ) from None
            self._replace(slot)
            return
        if message == verifier.READY:
            worker.ready = True
        elif message[0] == worker.task:
            results[message[0]] = float(message[1])
            worker.task, worker.deadline = None, math.inf

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.task is not None and now >= worker.deadline:
                self.killed += 1
                self._replace(slot)
            elif not worker.ready and now >= worker.started + STARTUP_TIMEOUT_S:
                raise RuntimeError(
                    f"a math verifier process did not start within {STARTUP_TIMEOUT_S:.0f} s; "
                    "the machine is overloaded or math-verify cannot be imported"
                )

    def close(self) -> None:
        """Stop every worker (politely, then by SIGKILL)."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            self._stop(worker)
        self._workers = []


# ---------------------------------------------------------------------------------------------
# Public entry points (one shared pool per process)

_POOL: VerifierPool | None = None
_POOL_LOCK = threading.Lock()


def default_workers() -> int:
    """Verifier processes when none are asked for: one per CPU, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def _shared_pool(workers: int) -> VerifierPool:
    global _POOL
    if _POOL is None or _POOL.size != workers:
        if _POOL is not None:
            _POOL.close()
        _POOL = VerifierPool(workers)
    return _POOL


@atexit.register
def shutdown_verifier_pool() -> None:
    """Stop the shared verifier processes (also runs at interpreter exit); the next call starts new ones."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def math_rewards(
    responses: Sequence[str], truths: Sequence[str], timeout_s: float = 5.0, workers: int | None = None
) -> list[float]:
    """Rewards (1.0 / 0.0) of response texts against ground-truth answers, verified in parallel.

    Each item is bounded by ``timeout_s`` of wall-clock time in a worker (then it scores 0.0); items without an
    extractable answer score 0.0 without leaving this process. ``workers``: verifier processes (default
    :func:`default_workers`); the pool is shared by all calls in this process and started on first use.
    """
    if len(responses) != len(truths):
        raise ValueError(f"{len(responses)} responses but {len(truths)} ground truths")
    answers = [extract_final_answer(response) for response in responses]
    todo = [index for index, answer in enumerate(answers) if answer is not None and str(truths[index]).strip()]
    rewards = [0.0] * len(responses)
    if not todo:
        return rewards
    pairs = [(answers[index], str(truths[index])) for index in todo]
    with _POOL_LOCK:
        scores = _shared_pool(workers or default_workers()).score(pairs, timeout_s)
    for index, score in zip(todo, scores, strict=True):
        rewards[index] = score
    return rewards


def math_reward(response: str, ground_truth: str, timeout_s: float = 5.0) -> float:
    """1.0 if the final answer of ``response`` equals ``ground_truth`` (math-verify), else 0.0; at most about
    ``timeout_s`` seconds (see :func:`math_rewards`)."""
    return math_rewards([response], [ground_truth], timeout_s=timeout_s)[0]
