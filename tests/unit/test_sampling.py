"""SamplingParams end to end on the tiny llama: seeds, greedy equivalents, n, stops, logprobs and
penalties checked against transformers; the logit filters and parameter validation as units."""

from __future__ import annotations

import math

import pytest
import torch

from shardserve.config import EngineConfig
from shardserve.core import Request
from shardserve.engine.sampler import apply_logit_bias, apply_penalties, filter_logits, row_argmax
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore


@pytest.fixture(scope="module")
def tiny(tiny_model) -> tuple[str, torch.nn.Module]:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=tiny[0], show_progress=False, num_pages=512)


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(tiny[1].config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 30)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int, repetition: float = 1.0,
              presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """Greedy decoding with the penalties applied by hand to transformers' logits."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        for t in set(prompt + out):  # Hugging Face rule, over prompt and output
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):  # OpenAI rule, over output only
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def hf_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [len(out), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1)


# ----------------------------------------------------------------------------- seeds


def test_seed_reproduces_alone_and_batched(llm: LLM, prompts: list[list[int]]) -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12)
    alone = run(llm, [prompts[1]], sp)[0].token_ids
    assert run(llm, [prompts[1]], sp)[0].token_ids == alone
    others = [SamplingParams(temperature=0.8, top_k=50, max_tokens=20), SamplingParams(temperature=0, max_tokens=4)]
    batched = run(llm, [prompts[0], prompts[1], prompts[2]], [others[0], sp, others[1]])
    assert batched[1].token_ids == alone
    assert len(alone) == 12


def test_different_seeds_differ(llm: LLM, prompts: list[list[int]]) -> None:
    outs = [run(llm, [prompts[1]], SamplingParams(temperature=1.0, seed=s, max_tokens=12))[0].token_ids
            for s in (1, 2)]
    assert outs[0] != outs[1]


def test_unseeded_requests_differ(llm: LLM, prompts: list[list[int]]) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    assert run(llm, [prompts[1]], sp)[0].token_ids != run(llm, [prompts[1]], sp)[0].token_ids


# ----------------------------------------------------------------------------- greedy equivalents


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_1_is_greedy(llm: LLM, tiny, prompts: list[list[int]], temperature: float) -> None:
    greedy = [o.token_ids for o in run(llm, prompts, SamplingParams(temperature=0, max_tokens=10))]
    assert greedy == [hf_greedy(tiny[1], p, 10) for p in prompts]
    top1 = run(llm, prompts, SamplingParams(temperature=temperature, top_k=1, max_tokens=10, seed=3))
    assert [o.token_ids for o in top1] == greedy


# ----------------------------------------------------------------------------- n samples


def test_n_samples(llm: LLM, prompts: list[list[int]]) -> None:
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=7, seed=9)
    first = run(llm, prompts[:2], sp)
    for out in first:
        assert len(out.outputs) == 3
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # near-uniform model: samples differ
    again = run(llm, prompts[:2], sp)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in first]


def test_n_greedy_samples_are_identical(llm: LLM, prompts: list[list[int]]) -> None:
    out = run(llm, [prompts[0]], SamplingParams(n=2, temperature=0, max_tokens=6))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


# ----------------------------------------------------------------------------- stopping


def test_stop_token_ids(llm: LLM, prompts: list[list[int]]) -> None:
    greedy = run(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    stop = greedy[6]
    cut = greedy.index(stop) + 1
    out = run(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop, 300]))[0]
    assert out.token_ids == greedy[:cut]
    assert out.token_ids[-1] == stop
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop


def test_max_tokens_is_length(llm: LLM, prompts: list[list[int]]) -> None:
    for out in run(llm, prompts, SamplingParams(temperature=1.0, max_tokens=5)):
        assert len(out.token_ids) == 5
        assert out.finish_reason == "length"
        assert out.outputs[0].stop_reason is None


def test_stop_strings_need_a_tokenizer(tiny, prompts: list[list[int]]) -> None:
    core = EngineCore(EngineConfig(model=tiny[0], show_progress=False, num_pages=64))  # no decode function
    with pytest.raises(ValueError, match="tokenizer"):
        core.add_request("a", prompts[0], SamplingParams(stop=["x"]))


def test_stop_string_completed_by_a_long_token(tiny) -> None:
    """The match may start well before a long final token: the search must not miss it."""
    path, model = tiny

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" + "." * 20 for t in ids)  # every token is 25+ characters

    core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64), decode=decode)
    prompt = [1, 2, 3, 4, 5]
    greedy = hf_greedy(model, prompt, 8)
    stop = "." + f"<{greedy[3]}>"  # the last character of one token, then the next one's start
    full = decode(greedy)
    ends = next(i for i in range(1, 9) if stop in decode(greedy[:i]))  # 4 unless greedy[3] came earlier
    req = core.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=8, stop=[stop]))
    while core.has_unfinished():
        core.step()
    assert req.output_token_ids == greedy[:ends]
    assert req.finish_reason == "stop" and req.stop_reason == stop
    assert req.text_cut == full.index(stop)


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_greedy_match_transformers(llm: LLM, tiny, prompts: list[list[int]]) -> None:
    k = 5
    out = run(llm, [prompts[2]], SamplingParams(temperature=0, max_tokens=8, logprobs=k))[0]
    ref = hf_logprobs(tiny[1], prompts[2], out.token_ids)
    assert len(out.logprobs) == 8
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry["token_id"] == tok
        assert math.isclose(entry["logprob"], float(ref[step, tok]), abs_tol=1e-4)
        top = entry["top_logprobs"]
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert top[0][0] == tok  # greedy picks the most likely token
        ref_vals, ref_ids = ref[step].topk(k)
        assert [i for i, _ in top] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_vals, atol=1e-4, rtol=0)


def test_logprobs_are_of_the_raw_distribution_when_sampling(llm: LLM, tiny, prompts: list[list[int]]) -> None:
    sp = SamplingParams(temperature=0.7, top_k=2, max_tokens=6, logprobs=2, seed=5, repetition_penalty=1.3)
    out = run(llm, [prompts[0]], sp)[0]
    ref = hf_logprobs(tiny[1], prompts[0], out.token_ids)
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert math.isclose(entry["logprob"], float(ref[step, tok]), abs_tol=1e-4)  # before temperature
        assert len(entry["top_logprobs"]) == 2


def test_logprobs_zero_and_none(llm: LLM, prompts: list[list[int]]) -> None:
    zero, none = run(llm, [prompts[0]] * 2, [SamplingParams(temperature=1.0, max_tokens=3, logprobs=0),
                                             SamplingParams(temperature=1.0, max_tokens=3)])
    assert [e["top_logprobs"] for e in zero.logprobs] == [[], [], []]
    assert [e["token_id"] for e in zero.logprobs] == zero.token_ids
    assert none.logprobs is None


def test_min_p_samples_stay_above_threshold(llm: LLM, prompts: list[list[int]]) -> None:
    sp = SamplingParams(temperature=1.0, min_p=0.8, max_tokens=10, logprobs=1, seed=0)
    for entry in run(llm, [prompts[1]], sp)[0].logprobs:
        best = entry["top_logprobs"][0][1]
        assert entry["logprob"] >= best + math.log(0.8) - 1e-5


# ----------------------------------------------------------------------------- penalties


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 2.0},
    {"repetition_penalty": 0.5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.5},
])
def test_penalties_match_reference(llm: LLM, tiny, prompts: list[list[int]], penalty: dict[str, float]) -> None:
    steps = 24
    prompt = prompts[0]
    plain = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=steps))[0].token_ids
    out = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=steps, **penalty))[0].token_ids
    assert out != plain
    ref = hf_greedy(tiny[1], prompt, steps, penalty.get("repetition_penalty", 1.0),
                    penalty.get("presence_penalty", 0.0), penalty.get("frequency_penalty", 0.0))
    assert out == ref


def test_repetition_penalty_matches_transformers_generate(llm: LLM, tiny, prompts: list[list[int]]) -> None:
    prompt = prompts[1]
    with torch.no_grad():
        ref = tiny[1].generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               repetition_penalty=2.0)[0, len(prompt):].tolist()
    assert run(llm, [prompt], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=2.0))[0].token_ids == ref


def penalties_from_scratch(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The penalties recomputed over every token each step (the former, O(context) code)."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.3, "presence_penalty": 0.7, "frequency_penalty": 0.4},
    {"repetition_penalty": 0.8, "presence_penalty": -0.5, "frequency_penalty": 1.1},
    {"repetition_penalty": 1.7},
    {"frequency_penalty": 0.3},
])
def test_incremental_penalties_equal_from_scratch(penalty: dict[str, float]) -> None:
    vocab, g = 97, torch.Generator().manual_seed(3)
    prompt = torch.randint(vocab, (40,), generator=g).tolist()
    req = Request("r", prompt, SamplingParams(temperature=1.0, **penalty))
    states: dict = {}  # the sampler's, by request id
    for step in range(60):
        logits = torch.randn(vocab, generator=g) * 4  # positive and negative logits
        got = apply_penalties(logits.clone(), req, states)
        assert torch.equal(got, penalties_from_scratch(logits.clone(), req)), step
        # Mostly repeats (of the prompt, of earlier output), sometimes a fresh token.
        pool = prompt[:5] + req.output_token_ids[-3:] if step % 4 else [int(torch.randint(vocab, (1,), generator=g))]
        req.append_token(pool[int(torch.randint(len(pool), (1,), generator=g))])
    assert len(set(req.output_token_ids)) < len(req.output_token_ids)


class CountingList(list):
    """A token list that counts the elements read from it by iteration or indexing."""

    def __init__(self, items: list[int]) -> None:
        super().__init__(items)
        self.read = 0

    def __iter__(self):
        self.read += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        self.read += len(range(*i.indices(len(self)))) if isinstance(i, slice) else 1
        return super().__getitem__(i)


def test_penalty_work_per_step_does_not_scale_with_context() -> None:
    vocab, context = 50, 20_000
    req = Request("r", [i % vocab for i in range(context)],
                  SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5))
    req._tokens = CountingList(req.all_token_ids)  # what all_token_ids returns, and append_token grows
    req.output_token_ids = CountingList(req.output_token_ids)
    logits, states = torch.randn(vocab), {}
    apply_penalties(logits.clone(), req, states)  # the first penalised step folds in the prompt, once
    assert req._tokens.read <= context
    for step in range(10):
        req.append_token(step % 3)
        req._tokens.read = req.output_token_ids.read = 0
        apply_penalties(logits.clone(), req, states)
        assert req._tokens.read <= 1, step  # only the token added since the last step
        assert req.output_token_ids.read <= 1, step
    assert torch.equal(apply_penalties(logits.clone(), req, states), penalties_from_scratch(logits.clone(), req))


# ----------------------------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_bans(llm: LLM, tiny, prompts: list[list[int]]) -> None:
    greedy = run(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    banned = run(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=6,
                                                   logit_bias={t: -100 for t in greedy}))[0].token_ids
    assert not set(banned) & set(greedy)
    with torch.no_grad():  # the least likely next token: +100 still makes it every token
        last = tiny[1](torch.tensor([prompts[1]])).logits[0, -1]
    low = int(last.argmin())
    forced = [run(llm, [prompts[1]], sp)[0] for sp in (
        SamplingParams(temperature=0, max_tokens=5, logit_bias={low: 100}, logprobs=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=5, logit_bias={low: 100}, repetition_penalty=1.3),
    )]
    assert [o.token_ids for o in forced] == [[low] * 5] * 2
    # Reported logprobs stay the model's own: the forced token is far from the top.
    first = forced[0].logprobs[0]
    assert first["logprob"] == pytest.approx(float(torch.log_softmax(last.float(), -1)[low]), abs=1e-4)
    assert first["top_logprobs"][0][0] != low


def test_logit_bias_is_added_before_penalties() -> None:
    # vLLM's order: bias, then the repetition penalty divides the biased logit.
    req = Request("r", [0], SamplingParams(repetition_penalty=2.0, logit_bias={0: 3.0, 2: -1.0}))
    row = apply_penalties(apply_logit_bias(torch.tensor([1.0, 1.0, 1.0]), req.params), req, {})
    assert row.tolist() == [2.0, 1.0, 0.0]


def test_logit_bias_outside_the_vocabulary_is_refused(llm: LLM, prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="logit_bias token id 301 "):
        run(llm, [prompts[0]], SamplingParams(max_tokens=2, logit_bias={301: 1.0}))


# ----------------------------------------------------------------------------- filter_logits


# Probabilities 0.15, 0.5, 0.1, 0.25 in a shuffled order, so the filters must map back from a sort.
PROBS = torch.tensor([0.15, 0.5, 0.1, 0.25])


def kept(**kw) -> list[int]:
    row = filter_logits(PROBS.log(), SamplingParams(**kw))
    return torch.isfinite(row).nonzero().flatten().tolist()


@pytest.mark.parametrize(("top_p", "expected"), [(0.3, [1]), (0.6, [1, 3]), (0.85, [0, 1, 3]), (0.95, [0, 1, 2, 3]),
                                                 (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, expected: list[int]) -> None:
    assert kept(top_p=top_p) == expected


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, [0, 1, 2, 3]), (0.25, [0, 1, 3]), (0.4, [1, 3]),
                                                 (0.6, [1]), (1.0, [1])])
def test_min_p_drops_below_fraction_of_max(min_p: float, expected: list[int]) -> None:
    assert kept(min_p=min_p) == expected


@pytest.mark.parametrize(("top_k", "expected"), [(1, [1]), (2, [1, 3]), (3, [0, 1, 3]), (4, [0, 1, 2, 3]),
                                                 (-1, [0, 1, 2, 3])])
def test_top_k(top_k: int, expected: list[int]) -> None:
    assert kept(top_k=top_k) == expected


def test_filters_compose_on_renormalised_probs() -> None:
    # top_k=3 leaves 0.5, 0.25, 0.15 (renormalised 0.56, 0.28, 0.17): top_p=0.8 then needs two.
    assert kept(top_k=3, top_p=0.8) == [1, 3]
    # min_p after top_k: 0.17 >= 0.29 * 0.56 survives; 0.1 was already gone.
    assert kept(top_k=3, min_p=0.29) == [0, 1, 3]


def test_temperature_scales_kept_logits() -> None:
    logits = PROBS.log()
    row = filter_logits(logits, SamplingParams(temperature=0.5, top_k=2))
    torch.testing.assert_close(row[[1, 3]], logits[[1, 3]] / 0.5)
    # Temperature sharpens before min_p: 0.25 is half the max at T=1, a quarter of it at T=0.5.
    assert kept(temperature=1.0, min_p=0.35) == [1, 3]
    assert kept(temperature=0.5, min_p=0.35) == [1]


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("name", "value"), [
    ("n", 0), ("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", 0), ("top_k", -2),
    ("min_p", 2), ("min_p", -0.1), ("logprobs", 100), ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]),
    ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -3), ("seed", 1.5), ("n", True),
    ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}), ("logit_bias", {"5": 1}), ("logit_bias", [1]),
    ("logit_bias", {1: float("nan")}),
])
def test_invalid_params_name_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} "):
        SamplingParams(**{name: value})


def test_valid_edge_params() -> None:
    sp = SamplingParams(top_p=1.0, min_p=1.0, logprobs=0, top_k=-1, temperature=0, stop="x")
    assert sp.stop == ["x"] and sp.greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_row_argmax_is_torch_argmax_ties_and_nan_included() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (7, 300), generator=g).float()  # many ties: the first maximum wins
    x[2, 40] = float("nan")  # a NaN counts as the maximum, as in torch
    x[3] = float("-inf")
    x[4, 9] = float("inf")
    want = x.argmax(-1).tolist()
    assert row_argmax(x) == want and all(type(t) is int for t in row_argmax(x))
    assert row_argmax(x[1::2]) == x[1::2].argmax(-1).tolist()  # strided rows
    assert row_argmax(x.double()) == want  # other dtypes through torch
    assert row_argmax(x[2:3]) == [40] and row_argmax(x[4:5]) == [9]  # one row: numpy's pass

