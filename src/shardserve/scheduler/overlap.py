"""--async-scheduling (vLLM's name; SGLang's overlap schedule): plan step n+1 while step n runs.

The leader's own rank runs its plans on an executor thread, in order, so the leader can make the
next plan while a forward runs. A request in the running plan whose token is still being sampled
is planned again at once: its next row's token is the placeholder `PENDING`, and the sampling rank
(this same rank: one stage, launch/checks.py) fills in the token it sampled for the request in the
plan before, which it always ran first, and sends it to its tensor-parallel peers. The leader
learns the token one step later, as it would anyway; what the step computes is the same, so the
tokens equal synchronous scheduling's (tests/unit/test_async_scheduling.py).

The price is one step of work after a request's end: a request that stops on the token the
running plan samples has been planned once more, and that row's result is dropped. A request that
will surely stop (its last `max_tokens`, the context limit) is not planned again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from shardserve.core import Request
from shardserve.distributed.communicator import CollectiveError
from shardserve.ipc.messages.plan import StepPlan, StepResult

POLL_S = 1.0  # how often a wait for a result checks that the executor thread is alive


class ExecutorError(RuntimeError):
    """The executor thread is gone (its plan's error is the cause)."""


class Executor:
    """Runs `execute(plan)` for each submitted plan on one thread, in order; results come back
    in the same order (`results`)."""

    def __init__(self, execute: Callable[[StepPlan], StepResult | None], name: str):
        self._execute = execute
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (plan := self._plans.get()) is not None:
            try:
                result = self._execute(plan)
            except BaseException as e:  # the leader raises it where it waits
                self._error = e
                self._results.put(None)
                return
            if result is not None:
                self._results.put(result)

    def submit(self, plan: StepPlan) -> None:
        self._check()
        self._plans.put(plan)

    def results(self, timeout_ms: int) -> list[StepResult]:
        """The results ready within `timeout_ms` (at least one if any arrives in time)."""
        deadline = time.monotonic() + timeout_ms / 1000
        out: list[StepResult] = []
        while True:
            try:
                item = self._results.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if out or left <= 0:
                    return out
                try:
                    item = self._results.get(timeout=min(left, POLL_S))
                except queue.Empty:
                    self._check()
                    continue
            if item is None:
                self._check()
            out.append(item)

    def _check(self) -> None:
        if isinstance(self._error, CollectiveError):  # a lost peer: the rank's loop ends in one line
            raise self._error
        if self._error is not None:
            raise ExecutorError(f"{self._thread.name}: a step failed: {self._error}") from self._error
        if not self._thread.is_alive():
            raise ExecutorError(f"{self._thread.name}: the executor thread has stopped")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the plans already submitted."""
        if self._thread.is_alive():
            self._plans.put(None)
            self._thread.join(timeout)


def plans_again(req: Request | None, in_flight: int, max_model_len: int) -> bool:
    """Whether `req`, answered by `in_flight` plans still running, may be planned now: exactly one
    plan is sampling its next token, and that token cannot be its last by length."""
    return (req is not None and not req.finished and in_flight == 1 and req.pending == 1
            and len(req.output_token_ids) + 1 < req.params.max_tokens and req.num_tokens + 1 < max_model_len
            and req.transfer is None)
