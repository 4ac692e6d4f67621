"""--async-scheduling: the leader plans step n+1 while step n runs, the tokens step n is still
sampling left as placeholders the sampling rank fills in (scheduler/overlap.py).

What a request gets must not change: on the default model (batch-invariant, so a request's
logits do not depend on what shares its step) every token and logprob equals synchronous
scheduling's, for greedy and seeded sampled requests, stop strings and tokens, penalties,
min_tokens, structured outputs, preemption and the prefix cache; every page comes back; a
request ended by its length runs no extra row.
"""

from __future__ import annotations

import pytest
import torch

from shardserve.distributed.communicator import CollectiveError
from shardserve.distributed.layout import LayoutError
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.overlap import ExecutorError
from shardserve.structured_outputs import StructuredOutputsParams


def prompts(n: int, seed: int, lo: int = 5, hi: int = 200) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lens]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampled requests of many lengths, with what the sampling rank keeps
    state for (penalties, min_tokens) and what the leader ends them on (stop strings, tokens)."""
    out = []
    for i in range(n):
        kw: dict = dict(max_tokens=3 + 5 * i, logprobs=2, seed=i)
        kw["temperature"] = 0 if i % 3 == 0 else 0.9
        if i % 4 == 1:
            kw["repetition_penalty"] = 1.3
        if i % 5 == 2:
            kw.update(stop=["e"], min_tokens=2)
        if i % 7 == 3:
            kw["top_p"] = 0.8
        out.append(SamplingParams(**kw))
    return out


def first_difference(want: list, got: list) -> str:
    """Where two runs' (tokens, logprobs, ...) per request first differ, named for a failure."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a == b:
            continue
        for j, (x, y) in enumerate(zip(a[0], b[0])):
            if x != y or (len(a) > 1 and a[1] and b[1] and a[1][j] != b[1][j]):
                return (f"request {i}, token {j}: synchronous {x} {a[1][j] if a[1] else ''}, "
                        f"async {y} {b[1][j] if b[1] else ''}")
        return f"request {i}: synchronous {a[0]} {a[2:]}, async {b[0]} {b[2:]}"
    return f"{len(want)} requests against {len(got)}"


def run(path: str, batch: list[list[int]], params, **kw):
    """(token ids, logprobs, finish reasons) per request, and the engine's counters."""
    llm = LLM(model=path, show_progress=False, **kw)
    core = llm.engine
    filled = []
    fill = core.worker._last_sampled
    core.worker._last_sampled = lambda rid: filled.append(rid) or fill(rid)
    try:
        outs = llm.generate(batch, params, use_tqdm=False)
        # generate returns once its requests are done; a plan made before the last of them ended
        # may still be running (its rows are dropped): wait for it before reading the counters.
        core.drain()
        alloc = core.allocator
        seen = dict(in_flight=core.max_in_flight, filled=len(filled), preempted=core.scheduler.num_preemptions,
                    held=alloc.num_pages - alloc.num_free, busy=dict(core.inflight.busy),
                    pending=sum(r.pending for r in core.requests.values()))
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outs], seen
    finally:
        llm.shutdown()


def test_tokens_and_logprobs_equal_synchronous(smollm2_path: str) -> None:
    batch, params = prompts(14, seed=1), mixed_params(14)
    want, sync = run(smollm2_path, batch, params)
    got, overlap = run(smollm2_path, batch, params, async_scheduling=True)
    assert got == want, first_difference(want, got)  # every token and logprob exactly
    assert sync["in_flight"] == 1 and sync["filled"] == 0
    assert overlap["in_flight"] == 2 and overlap["filled"] >= 10  # it did plan ahead, many times
    assert {r for _, _, r in want} >= {"stop", "length"}
    assert overlap["busy"] == {} and overlap["pending"] == 0
    assert overlap["held"] == sync["held"] == 0  # every page back (cached ones are free to take)


def test_equal_under_preemption(smollm2_path: str) -> None:
    batch = prompts(8, seed=2, lo=40, hi=90)
    params = [SamplingParams(max_tokens=48, temperature=0 if i % 2 else 1.0, seed=i, logprobs=1) for i in range(8)]
    small = dict(num_pages=30, page_size=16)  # 480 tokens for 8 requests reaching ~110 each
    want, sync = run(smollm2_path, batch, params, **small)
    got, overlap = run(smollm2_path, batch, params, async_scheduling=True, **small)
    assert sync["preempted"] > 0 and overlap["preempted"] > 0
    assert got == want, first_difference(want, got)
    assert overlap["held"] == sync["held"] == 0


def test_equal_with_cached_prefixes(smollm2_path: str) -> None:
    shared = prompts(1, seed=3, lo=70, hi=71)[0]
    batch = [shared + tail for tail in prompts(6, seed=4, lo=3, hi=20)] + [shared]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=1)
    llm = LLM(model=smollm2_path, show_progress=False, async_scheduling=True)
    try:
        first = llm.generate(batch, params, use_tqdm=False)
        again = llm.generate(batch, params, use_tqdm=False)  # prefixes from the cache now
    finally:
        llm.shutdown()
    assert all(o.num_cached_tokens >= 64 for o in again)
    want, _ = run(smollm2_path, batch, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in first] == [w[:2] for w in want]
    assert [o.outputs[0].token_ids for o in again] == [w[0] for w in want]


def test_structured_outputs_equal(smollm2_path: str) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=i,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i in range(4)]
    batch = prompts(4, seed=5)
    want, _ = run(smollm2_path, batch, params)
    got, overlap = run(smollm2_path, batch, params, async_scheduling=True)
    assert got == want, first_difference(want, got)
    assert overlap["filled"] > 0


def test_length_ends_run_no_extra_row(smollm2_path: str) -> None:
    """A request that ends on its last max_tokens token is not planned past it."""
    llm = LLM(model=smollm2_path, show_progress=False, async_scheduling=True)
    rows: dict[str, int] = {}
    sample = llm.engine.worker._sample_rows

    def counting(logits, reqs):
        for r in reqs:
            rows[r.request_id] = rows.get(r.request_id, 0) + 1
        return sample(logits, reqs)

    llm.engine.worker._sample_rows = counting
    try:
        outs = llm.generate(prompts(3, seed=6), [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
                                                 for k in (1, 7, 19)], use_tqdm=False)
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 7, 19]
    assert sorted(rows.values()) == [1, 7, 19]


def test_abort_in_flight_frees_everything(smollm2_path: str) -> None:
    llm = LLM(model=smollm2_path, show_progress=False, async_scheduling=True)
    core = llm.engine
    try:
        for i, p in enumerate(prompts(4, seed=7)):
            core.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0))
        while not any(r.pending for r in core.requests.values()):
            core.step()
        victim = next(r for r in core.requests.values() if r.pending)
        assert core.abort(victim.request_id)
        finished = set()
        while core.has_unfinished():
            finished |= {o.request.request_id for o in core.step() if o.finished}
        assert finished == {"0", "1", "2", "3"} - {victim.request_id}
        assert not core.inflight.busy and not core.inflight
        assert core.allocator.num_free == core.allocator.num_pages
    finally:
        llm.shutdown()


@pytest.mark.parametrize("error, raised, says", [
    (RuntimeError("kernel exploded"), ExecutorError, "rank 0 executor: a step failed: kernel exploded"),
    # a lost peer stays what it is, so the rank's loop ends in its one line (follower.serve_loop)
    (CollectiveError("rank 0: all_reduce on the tensor group failed: peer gone"), CollectiveError, "peer gone"),
])
def test_a_failed_step_is_raised_and_the_thread_ends(smollm2_path: str, error, raised, says) -> None:
    llm = LLM(model=smollm2_path, show_progress=False, async_scheduling=True)
    core = llm.engine

    def broken(plan):
        raise error

    core.executor._execute = broken
    try:
        core.add_request("a", prompts(1, seed=8)[0], SamplingParams(max_tokens=4))
        with pytest.raises(raised, match=says):
            for _ in range(10):
                core.step()
        assert not core.executor._thread.is_alive()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw, why", [
    (dict(pp_size=2), "needs --pp-size 1 and --cp-size 1 for now"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "--speculative-method"),
])
def test_refused_where_it_cannot_run(smollm2_path: str, kw: dict, why: str) -> None:
    with pytest.raises(LayoutError, match=f"--async-scheduling .*{why}"):
        LLM(model=smollm2_path, show_progress=False, async_scheduling=True, **kw)


def test_equal_in_a_scheduler_process(smollm2_path: str) -> None:
    """As the server runs it: the leader's loop in its own process, waiting inside `step`."""
    batch, params = prompts(6, seed=9), mixed_params(6)
    want, _ = run(smollm2_path, batch, params)
    llm = LLM(model=smollm2_path, show_progress=False, async_scheduling=True, isolated=True)
    try:
        outs = llm.generate(batch, params, use_tqdm=False)
    finally:
        llm.shutdown()
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outs]
    assert got == want, first_difference(want, got)


def test_prompt_logprobs_and_several_samples_equal(smollm2_path: str) -> None:
    """Prompt scoring over chunks (a chunk that scores waits for its result) and n samples."""
    batch = prompts(3, seed=12, lo=40, hi=120)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2, prompt_logprobs=1, logprobs=1)
    out = {}
    for mode in (False, True):
        llm = LLM(model=smollm2_path, show_progress=False, async_scheduling=mode, max_num_batched_tokens=64)
        try:
            res = llm.generate(batch, params, use_tqdm=False)
        finally:
            llm.shutdown()
        out[mode] = [(o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs]) for o in res]
    assert out[True] == out[False]
    assert all(len(o[0]) == len(p) and len(o[1]) == 2 for o, p in zip(out[True], batch))


def test_two_results_of_a_request_in_one_step_each_report_their_own_logprobs() -> None:
    """Under load one engine step can apply two results of a request (the plan planned ahead came
    back too) before either is sent: each output reports its own token's logprobs, the prompt's
    logprobs go with the first only, and only the last carries the finish reason. (Read from the
    request when sent, the first output reported the second token's logprobs: the e2e test of
    concurrent streams saw such a token id now and then.)"""
    from shardserve.core import Request
    from shardserve.scheduler.engine_results import StepOutput
    from shardserve.scheduler.outputs import token_out

    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=0, prompt_logprobs=0), (0,))
    req.prompt_logprobs = [{"token_id": 2}, {"token_id": 3}]
    outs = []
    for tok in (7, 9):
        req.append_token(tok)
        req.logprobs.append({"token_id": tok, "logprob": -0.5, "top_logprobs": []})
        outs.append(StepOutput(req, [tok], tok == 9))
    req.finish_reason = "length"
    first, second = (token_out(o) for o in outs)  # sent together, after both were applied
    assert [lp["token_id"] for lp in first.logprobs] == [7] and [lp["token_id"] for lp in second.logprobs] == [9]
    assert first.prompt_logprobs == req.prompt_logprobs and second.prompt_logprobs is None
    assert (first.finish_reason, second.finish_reason) == (None, "length")
    assert token_out(StepOutput(req, [], True)).logprobs == []  # an end with no token repeats none
