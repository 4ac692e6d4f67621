"""Speculative decoding: greedy outputs equal non-speculative ones token for token (logprobs too),
with n-gram lookup and with a draft model, through everything else the engine does; pages of
rejected positions are freed and never cached; bad settings are one line."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from tiny_tokenizer import save_tiny_tokenizer

from shardserve.config import EngineConfig
from shardserve.engine.proposers import ngram_lookup
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams

# Every step speculates (the default stops above 4 requests a step) and a repeated single token
# is enough to propose (the default wants 2): the tiny random models repeat little else.
ALWAYS = {"disable_by_batch_size": None}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, **ALWAYS}


def random_prompts(n: int, seed: int = 0, vocab: int = 301) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def target(tiny_model) -> str:
    return tiny_model("llama")[0]


@pytest.fixture(scope="module")
def draft(tiny_model, tmp_path_factory) -> str:
    """A smaller model of the same vocabulary: the target's first layer (agrees with it often
    enough that proposals are both accepted and rejected)."""
    model = copy.deepcopy(tiny_model("llama")[1])
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = str(tmp_path_factory.mktemp("draft"))
    model.save_pretrained(path)
    save_tiny_tokenizer(path, model.config.vocab_size)
    return path


def run(path: str, prompts, params, spec=None, **kw):
    with LLM(path, show_progress=False, num_pages=kw.pop("num_pages", 96), speculative_config=spec, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        counts = llm.engine.spec.counts if spec else None
        return outs, counts, llm.engine.scheduler.num_preemptions


def same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


def test_ngram_lookup() -> None:
    assert ngram_lookup([1, 2, 3, 9, 1, 2], 1, 3, 2) == [3, 9]  # the 2-token suffix, longest first
    assert ngram_lookup([5, 1, 7, 1, 8, 1], 1, 3, 4) == [8, 1]  # the most recent earlier "1"
    assert ngram_lookup([1, 2, 3], 1, 3, 2) == []
    assert ngram_lookup([4, 4, 4, 4], 2, 2, 3) == [4]  # a match ending just before the suffix


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_equals_plain(target: str, draft: str, method: str) -> None:
    prompts = random_prompts(6)
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=2)
    spec = NGRAM if method == "ngram" else {"model": draft, "num_speculative_tokens": 3, **ALWAYS}
    want, _, _ = run(target, prompts, params)
    got, counts, _ = run(target, prompts, params, spec)
    same(got, want)
    assert [o.logprobs for o in got] == [o.logprobs for o in want]  # the target's own, exactly
    # Both verdicts happened, and some step kept all proposals and its bonus token.
    assert 0 < counts.accepted < counts.proposed and counts.per_position[-1] > 0
    assert counts.emitted == counts.accepted + counts.drafts


def test_penalties_bias_and_bans_as_one_at_a_time(target: str) -> None:
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                            logit_bias={17: 5.0, 39: -100}, min_tokens=10, bad_words_token_ids=[[68, 39]])
    want, _, _ = run(target, prompts, params)
    got, counts, _ = run(target, prompts, params, NGRAM)
    same(got, want)
    assert counts.proposed > 0


def test_stop_token_and_max_tokens_inside_an_accepted_run(target: str, close_draft: str) -> None:
    # A draft model, not lookup: a lookup's accepted run repeats earlier tokens, so a stop token
    # in it would have stopped the request before.
    spec = {"model": close_draft, "num_speculative_tokens": 3, **ALWAYS}
    prompt = random_prompts(6)[0]
    greedy = SamplingParams(max_tokens=60, temperature=0)
    steps = []  # each step's new tokens
    with LLM(target, show_progress=False, num_pages=96, speculative_config=spec) as llm:
        rid = llm.add_request(prompt, greedy)
        while llm.engine.has_unfinished():
            steps += [o.new_ids for o in llm.step() if o.rid == rid and o.new_ids]
        out = [t for s in steps for t in s]
        text = [llm.tokenizer.decode(out[:k]) for k in range(len(out) + 1)]
    # A step that emitted 3+ tokens whose second is new to the output: it stops the request there.
    at = [sum(map(len, steps[:i])) for i in range(len(steps))]
    i = next(i for i, s in enumerate(steps) if len(s) >= 3 and s[1] not in out[: at[i] + 1])
    for params in (SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[steps[i][1]]),
                   SamplingParams(max_tokens=at[i] + 2, temperature=0)):
        want, _, _ = run(target, [prompt], params)
        got, _, _ = run(target, [prompt], params, spec)
        same(got, want)
        assert got[0].token_ids == out[: at[i] + 2]
    # A stop string: the text a run's second token adds, where that text is new to the output.
    def added(k: int) -> str:
        return text[k][len(text[k - 1]) :]

    k = next(at[i] + 2 for i, s in enumerate(steps)
             if len(s) >= 3 and added(at[i] + 2).strip() and added(at[i] + 2) not in text[at[i] + 1])
    params = SamplingParams(max_tokens=60, temperature=0, stop=[added(k)])
    want, _, _ = run(target, [prompt], params)
    got, _, _ = run(target, [prompt], params, spec)
    assert (got[0].text, got[0].finish_reason) == (want[0].text, want[0].finish_reason)
    assert want[0].finish_reason == "stop" and got[0].token_ids == want[0].token_ids == out[:k]


def test_rejected_pages_freed_and_never_cached(target: str) -> None:
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_tokens=60, temperature=0)
    with LLM(target, show_progress=False, num_pages=400, page_size=4, speculative_config=NGRAM) as llm:
        eng = llm.engine
        for p in prompts:
            llm.add_request(p, params)
        while eng.has_unfinished():
            llm.step()
            alloc = eng.allocator
            for req in eng.scheduler.running:
                assert len(req.pages) == -(-req.num_computed_tokens // 4)  # no page of only rejected positions
                for i, page in enumerate(req.pages):
                    if page in alloc.hash_of:  # a cached page holds exactly the request's verified tokens
                        assert alloc.content[page][1] == tuple(req.all_token_ids[i * 4 : (i + 1) * 4])
        assert eng.spec.counts.accepted < eng.spec.counts.proposed
        assert alloc.num_used == 0
        first = llm.generate(prompts, params, use_tqdm=False)
        # Prompts that are an earlier output: served from the cache the speculation filled.
        again = [p + o.token_ids[:40] for p, o in zip(prompts, first)]
        cached = llm.generate(again, params, use_tqdm=False)
    assert min(o.num_cached_tokens for o in cached) > 0
    want, _, _ = run(target, again, params, enable_prefix_cache=False)
    same(cached, want)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_during_speculation(target: str, draft: str, method: str) -> None:
    prompts = random_prompts(8, seed=9)
    params = SamplingParams(max_tokens=48, temperature=0)
    spec = NGRAM if method == "ngram" else {"model": draft, "num_speculative_tokens": 3, **ALWAYS}
    want, _, _ = run(target, prompts, params)
    got, counts, preempted = run(target, prompts, params, spec, num_pages=14)
    same(got, want)
    assert preempted > 0 and counts.accepted > 0


def test_seeded_sampling_reproducible(target: str, draft: str) -> None:
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(n=2, max_tokens=32, temperature=0.8, top_p=0.9, seed=11)
    spec = {"model": draft, "num_speculative_tokens": 3, **ALWAYS}
    first, counts, _ = run(target, prompts, params, spec)
    second, _, _ = run(target, prompts, params, spec)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in second]
    assert counts.accepted > 0


def test_structured_output_with_speculation(smollm2_path: str) -> None:
    from shardserve.structured_outputs import StructuredOutputsParams

    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}}},
              "required": ["names"]}
    prompt = [{"role": "user", "content": "List the names Anna, Bob, Anna, Bob, Anna and Bob as JSON."}]
    params = SamplingParams(max_tokens=48, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        with LLM(smollm2_path, show_progress=False, kv_cache_memory=2**27, speculative_config=spec) as llm:
            outs.append(llm.chat(prompt, params, use_tqdm=False))
            counts = llm.engine.spec.counts if spec else None
    assert outs[1].token_ids == outs[0].token_ids and outs[1].finish_reason == outs[0].finish_reason
    assert counts.accepted > 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "--speculative-method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "--num-speculative-tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "--num-speculative-tokens must be an integer in [1, 16]"),
    ({"method": "draft", "num_speculative_tokens": 2}, "--speculative-model is needed"),
    ({"num_speculative_tokens": 2, "ngram_min": 3, "ngram_max": 2}, "--ngram-max must be an integer >= --ngram-min"),
    ({"num_speculative_tokens": 2, "window": 3}, "unknown field(s) ['window']"),
])
def test_bad_settings(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(speculative_config=spec)


def test_draft_with_another_vocabulary_refused(target: str, tiny_model, tmp_path) -> None:
    from shardserve.distributed.layout import LayoutError

    other = tmp_path / "other"
    model = tiny_model("qwen2")[1]
    small = type(model)(model.config.__class__(**{**model.config.to_dict(), "vocab_size": 300}))
    small.save_pretrained(str(other))
    with pytest.raises(LayoutError, match="its vocabulary has 300 tokens, the target's 301"):
        LLM(target, show_progress=False, speculative_config={"model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(LayoutError, match="needs --pp-size 1"):
        LLM(target, show_progress=False, pp_size=2, speculative_config=NGRAM)


def test_chunked_prefill_beside_verifications(target: str, draft: str) -> None:
    long = random_prompts(1, seed=21)[0] * 6  # > 64 tokens: prefilled in chunks while others verify
    prompts = random_prompts(3, seed=22) + [long]
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=1)
    want, _, _ = run(target, prompts, params)
    for spec in (NGRAM, {"model": draft, "num_speculative_tokens": 3, **ALWAYS}):
        got, counts, _ = run(target, prompts, params, spec, max_num_batched_tokens=24)
        same(got, want)
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
        assert counts.accepted > 0


def test_abort_during_speculation_frees_both_caches(target: str, draft: str) -> None:
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0)
    want, _, _ = run(target, prompts[1:], params)
    with LLM(target, show_progress=False, num_pages=96, speculative_config={"model": draft, "num_speculative_tokens": 3,
                                                                            **ALWAYS}) as llm:
        eng = llm.engine
        rids = [llm.add_request(p, params) for p in prompts]
        outs: dict[str, list[int]] = {r: [] for r in rids}
        for _ in range(6):
            for o in llm.step():
                outs[o.rid] += o.new_ids
        assert eng.spec.proposer.kv[rids[0]].pages  # the draft holds KV for it
        assert eng.abort(rids[0])
        assert rids[0] not in eng.spec.proposer.kv
        while eng.has_unfinished():
            for o in llm.step():
                outs[o.rid] += o.new_ids
        assert eng.spec.proposer.alloc.num_used == 0 and eng.allocator.num_used == 0
    assert [outs[r] for r in rids[1:]] == [o.token_ids for o in want]


def test_draft_that_does_not_fit_refused(target: str, draft: str, monkeypatch) -> None:
    from shardserve.distributed.layout import LayoutError
    from shardserve.launch import spec_checks

    monkeypatch.setattr(spec_checks, "checkpoint_bytes", lambda ckpt: 2**50 if ckpt.path == draft else 0)
    with pytest.raises(LayoutError, match=r"--speculative-model draft\d*: its weights \(1048576.0 GiB\)"):
        LLM(target, show_progress=False, speculative_config={"model": draft, "num_speculative_tokens": 2})


def test_off_above_the_batch_size(target: str) -> None:
    prompts = random_prompts(6, seed=8)
    params = [SamplingParams(max_tokens=10 + 10 * i, temperature=0) for i in range(6)]  # the batch shrinks
    with LLM(target, show_progress=False, num_pages=96,
             speculative_config={**NGRAM, "disable_by_batch_size": 2}) as llm:
        spec, sizes = llm.engine.spec, []
        extend = spec.extend

        def recording(batch):
            drafts = extend(batch)
            sizes.append((len(batch.entries), bool(drafts)))
            return drafts

        spec.extend = recording
        got = llm.generate(prompts, params, use_tqdm=False)
    assert any(n > 2 for n, _ in sizes) and all(n <= 2 for n, drafted in sizes if drafted)
    assert any(drafted for _, drafted in sizes)
    want, _, _ = run(target, prompts, params)
    same(got, want)


def test_draft_pool_full_is_counted_and_said(target: str, close_draft: str, caplog) -> None:
    # 64 shared tokens: the target's prefix cache holds them once (8 pages), the draft once per
    # request (12 x 8 pages > its 60).
    prompts = [list(range(50, 114)) + [i] for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0)
    want, _, _ = run(target, prompts, params, num_pages=60)
    spec = {"model": close_draft, "num_speculative_tokens": 3, **ALWAYS}
    with caplog.at_level("WARNING", logger="shardserve.engine.draft_proposer"), \
            LLM(target, show_progress=False, num_pages=60, speculative_config=spec) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        counts = llm.stats().speculative
    same(got, want)
    assert counts["draft_pool_full"] > 0 and counts["accepted"] > 0
    assert sum("the draft's KV pool is full" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("spec, message", [
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": "same"}, "--speculative-draft-tp places a draft"),
    ({"model": "x", "num_speculative_tokens": 2, "ngram_min": 3}, "--ngram-min and --ngram-max are for"),
])
def test_settings_of_the_other_method_refused(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(speculative_config=spec)


def test_flags(target: str) -> None:
    from shardserve.cli.flag_types import Parser
    from shardserve.cli.flags import add_engine_args, speculative_config

    p = Parser()
    add_engine_args(p)
    spec = speculative_config(p.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "5",
                                            "--ngram-max", "6", "--speculative-disable-by-batch-size", "0"]))
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max, spec.disable_by_batch_size) \
        == ("ngram", 5, 2, 6, None)
    for argv, message in ((["--speculative-model", target], "--speculative-model needs --speculative-method draft"),
                          (["--speculative-method", "draft", "--speculative-model", target, "--ngram-min", "1",
                            "--num-speculative-tokens", "2"], "--ngram-min needs --speculative-method ngram"),
                          (["--speculative-method", "ngram"], "needs --num-speculative-tokens K")):
        with pytest.raises(ValueError, match=re.escape(message)):
            speculative_config(p.parse_args(argv))


def test_draft_shorter_context_refused(target: str, tiny_model, tmp_path) -> None:
    from shardserve.distributed.layout import LayoutError

    model = copy.deepcopy(tiny_model("llama")[1])
    model.config.max_position_embeddings = 128
    model.save_pretrained(str(tmp_path))
    save_tiny_tokenizer(str(tmp_path), model.config.vocab_size)
    spec = {"model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(LayoutError, match="it takes 128 positions, sequences here may reach 512"):
        LLM(target, show_progress=False, speculative_config=spec)
    LLM(target, show_progress=False, max_model_len=128, num_pages=16, speculative_config=spec).shutdown()
