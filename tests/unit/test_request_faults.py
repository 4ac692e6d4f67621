"""One request cannot take a rank down: a fault in its logits (non-finite), its grammar matcher, its detokenizing
or its tool-call parsing fails that request, naming the cause, and the batch's other requests go on unchanged."""

from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams
from shardserve.structured_outputs import StructuredOutputsParams

A, B = [5, 6, 7, 8], [9, 10, 11]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    return drive(llm, [llm.add_request(p, sp) for p, sp in requests])


def drive(llm: LLM, rids: list[str]) -> dict[str, dict]:
    """step() until these requests end: per request id, its tokens, finish reason and error."""
    outs = {rid: {"tokens": [], "finish": None, "error": None} for rid in rids}
    left = set(outs)
    while left:
        for o in llm.step():
            outs[o.rid]["tokens"] += o.new_ids
            if o.finished:
                outs[o.rid].update(finish=o.finish_reason, error=o.error)
                left.discard(o.rid)
    return outs


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model("llama")[0], num_pages=64, page_size=8, show_progress=False) as one:
        yield one


def test_non_finite_logits_fail_that_request_alone(llm):
    alone = llm.generate([B], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    worker = llm.engine.worker
    sample, poisoned = worker._sample, {}

    def nan_for_a(plan, logits):  # A's rows overflow at its fourth token
        sampled = [e for e in plan.entries if e.sample]
        for k, e in enumerate(sampled):
            if e.rid == poisoned.get("rid") and len(worker.sampling[e.rid].output_token_ids) == 3:
                logits = logits.clone()
                logits[k] = float("nan")
        return sample(plan, logits)

    worker._sample = nan_for_a
    try:
        poisoned["rid"] = rid_a = llm.add_request(A, GREEDY)
        rid_b = llm.add_request(B, GREEDY)
        outs = drive(llm, [rid_a, rid_b])
    finally:
        worker._sample = sample
    a, b = outs[rid_a], outs[rid_b]
    assert a["finish"] == "error" and "not finite" in a["error"] and len(a["tokens"]) == 3
    assert b["finish"] == "length" and b["tokens"] == alone and b["error"] is None
    assert llm.stats().pages_used == 0  # every page back
    # The engine serves on: A again, unpoisoned, runs to its length.
    assert llm.generate([A], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


class _Exploding:
    """A matcher that raises on its third token, as a grammar engine bug would."""

    def __init__(self, inner):
        self.inner, self.seen = inner, 0

    def consume_token(self, tok):
        self.seen += 1
        if self.seen == 3:
            raise RuntimeError("matcher exploded")
        return self.inner.consume_token(tok)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_grammar_engine_fault_fails_that_request_alone(llm):
    guide = llm.engine.worker.guide
    matcher = guide.matcher
    guide.matcher = lambda spec: _Exploding(matcher(spec))
    regex = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    try:
        outs = run(llm, [(A, regex), (B, GREEDY)])
    finally:
        guide.matcher = matcher
    failed = [v for v in outs.values() if v["finish"] == "error"]
    (ok,) = [v for v in outs.values() if v["finish"] != "error"]
    assert len(failed) == 1 and "grammar engine failed" in failed[0]["error"] and "exploded" in failed[0]["error"]
    assert ok["finish"] == "length" and len(ok["tokens"]) == 8 and not guide.failures


def test_a_detokenizer_fault_fails_that_request_alone(tiny_tok):
    from shardserve.ipc.messages.api import TokenOut
    from shardserve.tokenizer.detokenizer import Detokenizer

    class Faulty:
        def decode(self, ids, skip_special_tokens=True):
            if 13 in ids:
                raise ValueError("no such token")
            return tiny_tok.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = Detokenizer(Faulty())
    bad = detok.feed_safely(TokenOut(rid="a", new_ids=[13], finished=False))
    good = detok.feed_safely(TokenOut(rid="b", new_ids=[40, 41], finished=True))
    assert bad.error.startswith("detokenizing this request's output failed: no such token") and "a" not in detok.streams
    assert good.error is None and good.text == tiny_tok.decode([40, 41])


def test_a_tool_parser_fault_is_a_500_naming_it():
    from shardserve.server.errors import APIError
    from shardserve.server.tool_parsers import Hermes
    from shardserve.server.tools import ToolUse

    class Broken(Hermes):
        @classmethod
        def parse(cls, text):
            raise KeyError("arguments")

        def feed(self, delta, final=False):
            raise KeyError("arguments")

    use = ToolUse(Broken, [])
    for attempt in (lambda: use.message("x"), lambda: use.stream().deltas("x", False)):
        with pytest.raises(APIError) as e:
            attempt()
        assert e.value.status == 500 and "broken output parser failed on this output" in e.value.message


@pytest.mark.parametrize("c_pass", [True, False])  # False: a build without AVX-512 (numpy's few rows)
def test_one_non_finite_logit_fails_only_its_entry(c_pass, monkeypatch):
    """A single NaN, +inf or -inf among a row's finite logits is caught (the C pass on float32
    rows where it is built, else numpy's or torch's max and min); entries with finite rows are
    kept as they were."""
    from types import SimpleNamespace

    from shardserve.engine.step_rows import finite_rows
    from shardserve.layers import cpu_ops

    if not c_pass:
        monkeypatch.setattr(cpu_ops, "rows_finite", lambda logits: None)
    entries = [SimpleNamespace(num_draft=0), SimpleNamespace(num_draft=1), SimpleNamespace(num_draft=0),
               SimpleNamespace(num_draft=0)]
    for bad_value in (float("nan"), float("inf"), -float("inf")):
        logits = torch.randn(5, 50)
        logits[2, 17] = bad_value  # the second entry's draft row
        logits[4, 0] = bad_value
        out, failed = finite_rows(logits, 5, entries)
        assert sorted(failed) == [1, 3]
        assert torch.equal(out[[0, 3]], logits[[0, 3]]) and not out[[1, 2, 4]].any()
    clean = torch.randn(5, 50)
    assert finite_rows(clean, 5, entries) == (clean, {})
    many = [SimpleNamespace(num_draft=0)] * 12  # float64: the check's other branch (torch's reductions)
    for bad_value in (float("nan"), float("inf"), -float("inf")):
        logits = torch.randn(12, 50, dtype=torch.float64)
        logits[9, 3] = bad_value
        out, failed = finite_rows(logits, 12, many)
        assert sorted(failed) == [9] and not out[9].any() and torch.equal(out[:9], logits[:9])
