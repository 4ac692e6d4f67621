"""Structured outputs (SamplingParams.structured_outputs): JSON schemas, any JSON object, regexes,
EBNF grammars and choices, enforced token by token on the sampling rank, so a random tiny model
sampling at temperature 1 still writes outputs that parse and validate; with n > 1, EOS,
preemption, tensor and pipeline parallelism; log-probabilities stay the model's raw ones."""

from __future__ import annotations

import json
import os
import re
import shutil

import jsonschema
import pytest

from shardserve import LLM, SamplingParams, StructuredOutputsParams
from shardserve.engine.grammar import Guide
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@(foo|bar)\.com"
GRAMMAR = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [1-9] [0-9]?'
ENGINE = dict(show_progress=False, num_pages=64)
SEEDS = range(12)


def check_schema(text: str) -> dict:
    """The text parses and validates against SCHEMA (jsonschema, and by hand)."""
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    assert set(obj) <= set(SCHEMA["properties"]) and {"name", "age", "color"} <= set(obj)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert obj["color"] in ("red", "green", "blue")
    assert type(obj.get("ok", True)) is bool
    return obj


def sampled(spec: StructuredOutputsParams, seeds=SEEDS, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=kw.pop("max_tokens", 80), temperature=1.0, seed=s, structured_outputs=spec, **kw)
            for s in seeds]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model("llama")[0], **ENGINE) as llm:
        yield llm


def test_json_schema_validates_for_every_seed(llm):
    outs = llm.generate(["Hello"] * len(SEEDS), sampled(StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    objs = [check_schema(o.text) for o in outs]
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({json.dumps(o) for o in objs}) > len(objs) // 2  # really sampled, not one forced answer


def test_json_schema_given_as_text_and_n_2(llm):
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    outs = llm.generate(["Hi", "Hello"], SamplingParams(n=2, max_tokens=80, temperature=1.0, seed=3,
                                                        structured_outputs=spec), use_tqdm=False)
    for out in outs:
        texts = [c.text for c in out.outputs]
        assert len(texts) == 2 and texts[0] != texts[1]  # each sample its own matcher
        for t in texts:
            check_schema(t)


@pytest.mark.parametrize("spec, pattern", [
    (StructuredOutputsParams(regex=REGEX), REGEX),
    (StructuredOutputsParams(grammar=GRAMMAR), r"\([1-9][0-9]?(,[1-9][0-9]?){0,3}\)"),
    (StructuredOutputsParams(grammar='start: "yes" | "no" | /maybe [0-9]/'), r"yes|no|maybe [0-9]"),  # Lark
    (StructuredOutputsParams(choice=["Paris", "Rome", "Berlin"]), r"Paris|Rome|Berlin"),
], ids=["regex", "ebnf", "lark", "choice"])
def test_regex_grammar_choice(llm, spec, pattern):
    outs = llm.generate(["Hello"] * len(SEEDS), sampled(spec), use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text


def test_json_object(llm):
    """Any JSON object: a random model's strings run long, so some outputs hit max_tokens; each
    finished one parses to an object, and every token of the others was one the grammar allows."""
    from llguidance import LLMatcher

    from shardserve.structured_outputs import grammar_of

    spec = StructuredOutputsParams(json_object=True)
    outs = llm.generate(["Hello"] * len(SEEDS), sampled(spec, max_tokens=40), use_tqdm=False)
    assert any(o.finish_reason == "stop" for o in outs)
    tok = Guide(resolve_checkpoint(llm.config.model), 301, llm.tokenizer)._tokenizer()
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length" and o.text.startswith("{")
            matcher = LLMatcher(tok, grammar_of(*spec.key()))
            assert matcher.try_consume_tokens(o.token_ids) == len(o.token_ids)


def test_eos_only_once_complete(tiny_model, tmp_path):
    """A model with an EOS token: it may end the output only where the grammar is complete (here
    at once, with EOS favoured by a logit bias), and not at all with ignore_eos."""
    src, _ = tiny_model("llama")
    path = str(tmp_path / "eos")
    shutil.copytree(src, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg | {"eos_token_id": 1}, f)  # <|im_end|>
    spec = StructuredOutputsParams(regex="[a-z]+")
    with LLM(path, **ENGINE) as llm:
        outs = llm.generate(["Hello"] * len(SEEDS), sampled(spec, logit_bias={1: 100}), use_tqdm=False)
        ignoring = llm.generate(["Hello"] * 3, sampled(spec, range(3), max_tokens=30, ignore_eos=True,
                                                       logit_bias={1: 100}), use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop" and len(o.token_ids) == 2 and o.token_ids[-1] == 1
        assert re.fullmatch("[a-z]+", o.text), o.text
    for o in ignoring:
        assert o.finish_reason == "length" and 1 not in o.token_ids and re.fullmatch("[a-z]+", o.text)


def test_logprobs_are_the_raw_distribution(llm):
    """The sampled token's logprob and the top list come from the unmasked logits."""
    raw = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)[0]
    spec = StructuredOutputsParams(regex="[0-9]+")
    guided = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0, logprobs=3, structured_outputs=spec),
                          use_tqdm=False)[0]
    assert guided.logprobs[0]["top_logprobs"] == raw.logprobs[0]["top_logprobs"]
    assert re.fullmatch("[0-9]", guided.text)
    if raw.token_ids != guided.token_ids:  # the model's own choice was banned: its logprob is lower
        assert guided.logprobs[0]["logprob"] < raw.logprobs[0]["logprob"]


def test_preemption_keeps_the_matcher(tiny_model):
    """A crowded pool preempts requests mid-output; recomputing their KV never re-samples, so the
    outputs are the very ones a roomy pool gives."""
    path, _ = tiny_model("llama")
    params = sampled(StructuredOutputsParams(json=SCHEMA), range(8), max_tokens=100)
    prompt = "The capital of France is Paris. The capital of Italy is Rome."
    with LLM(path, **ENGINE) as roomy:
        want = [o.text for o in roomy.generate([prompt] * 8, params, use_tqdm=False)]
    with LLM(path, show_progress=False, page_size=4, num_pages=48) as crowded:
        got = [o.text for o in crowded.generate([prompt] * 8, params, use_tqdm=False)]
        assert crowded.engine.scheduler.num_preemptions > 0
    assert got == want
    for t in got:
        check_schema(t)


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(pp_size=2)], ids=["tp2", "pp2"])
def test_parallel_layouts(tiny_model, layout):
    """The mask applies where sampling happens: the leader under TP, the last stage (another
    process, loading its own tokenizer) under PP."""
    with LLM(tiny_model("llama")[0], **ENGINE, **layout) as llm:
        outs = llm.generate(["Hello"] * 6, sampled(StructuredOutputsParams(json=SCHEMA), range(6)), use_tqdm=False)
        regex = llm.generate(["Hello"] * 3, sampled(StructuredOutputsParams(regex=REGEX), range(3)), use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop"
        check_schema(o.text)
    assert all(re.fullmatch(REGEX, o.text) for o in regex)


@pytest.mark.parametrize("kwargs, message", [
    (dict(json={"type": "foo"}), "invalid JSON schema: Invalid type: foo"),
    (dict(json='{"type": "object"'), "structured_outputs.json is not valid JSON"),
    (dict(regex="[a-"), "invalid regex"),
    (dict(grammar='root ::= ("a"'), "invalid grammar"),
    (dict(regex="a", json_object=True), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(choice=[]), "choice must be a list of non-empty strings"),
])
def test_bad_specs_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        SamplingParams(structured_outputs=kwargs)
    assert "\n" not in str(info.value)


def test_mask_is_as_wide_as_the_logits(tiny_model):
    """A model vocabulary wider than its tokenizer's: the extra ids are never allowed."""
    import torch

    from shardserve.core import Request

    path, _ = tiny_model("llama")
    guide = Guide(resolve_checkpoint(path), 320, load_tokenizer(resolve_checkpoint(path)))
    req = Request("r", [5], SamplingParams(structured_outputs={"regex": "[a-z]+"}), eos_token_ids=(1,))
    req.matcher = guide.matcher(req.params.structured_outputs)
    row = guide.mask(torch.zeros(1, 320), [req])[0]
    allowed = torch.isfinite(row).nonzero().flatten().tolist()
    assert allowed and max(allowed) < 301 and 1 not in allowed  # letters only; no EOS before one
    assert guide.accept([req], [allowed[0]]) == []
    row = guide.mask(torch.zeros(1, 320), [req])[0]
    assert torch.isfinite(row[1])  # complete now: EOS allowed
    assert guide.accept([req], [1]) == [0]


def test_stop_string_ends_a_constrained_output(llm):
    """A stop string still ends the output (a prefix of what the grammar allows, as in vLLM): the
    structured outputs' end and the stop string's are both "stop", with the stop string cut."""
    spec = StructuredOutputsParams(regex=r"(ab|cd){3,6}x")
    free = llm.generate(["Hello"] * 4, sampled(spec, seeds=range(4)), use_tqdm=False)
    stopped = llm.generate(["Hello"] * 4, sampled(spec, seeds=range(4), stop=["cd"]), use_tqdm=False)
    assert any("cd" in f.text for f in free)  # the stop string really cuts some
    for f, s in zip(free, stopped):
        assert re.fullmatch(r"(ab|cd){3,6}x", f.text) and f.finish_reason == "stop"
        cut = f.text.find("cd")
        assert s.finish_reason == "stop" and s.text == (f.text[:cut] if cut >= 0 else f.text)


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
def test_json_schema_on_latent_attention_and_mixtral(tiny_model, arch):
    """The grammar masks the sampler's rows whatever the architecture (latent attention's cache,
    DeepSeek's and Mixtral's gates), with sampled logprobs beside them."""
    with LLM(tiny_model(arch)[0], **ENGINE) as one:
        outs = one.generate(["Hello"] * 4, sampled(StructuredOutputsParams(json=SCHEMA), seeds=range(4), logprobs=1),
                            use_tqdm=False)
    for o in outs:
        check_schema(o.text)
        assert o.finish_reason == "stop" and len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)


def test_unbounded_integer_cannot_run_away(llm, tiny_model):
    """A schema's unbounded integer holds at most 18 digits, so a model pushed to repeat a digit
    (logit_bias on "1") still closes the object; the schema's own bounds replace that limit."""
    tok = load_tokenizer(resolve_checkpoint(tiny_model("llama")[0]))
    one = tok.encode("1", add_special_tokens=False)
    assert len(one) == 1
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}
    params = SamplingParams(max_tokens=60, temperature=0, logit_bias={one[0]: 100},
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and json.loads(out.text) == {"population": int("1" * 18)}
    assert "minimum" not in schema["properties"]["population"]  # the caller's schema is untouched
    own = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 10**12}}}
    params = SamplingParams(max_tokens=60, temperature=0, logit_bias={one[0]: 100},
                            structured_outputs=StructuredOutputsParams(json=own | {"required": ["n"]}))
    assert json.loads(llm.generate(["Hello"], params, use_tqdm=False)[0].text) == {"n": int("1" * 12)}


def test_listed_properties_only_unless_the_schema_opens_the_object(llm, tiny_model):
    """An object schema that lists properties and says nothing of others takes no others (xgrammar's strict mode,
    vLLM's default), so a model pushed to add more (logit_bias on ",") still closes it; additionalProperties true
    keeps JSON Schema's default, and the model goes on."""
    tok = load_tokenizer(resolve_checkpoint(tiny_model("llama")[0]))
    (comma,) = tok.encode(",", add_special_tokens=False)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(max_tokens=40, temperature=0, logit_bias={comma: 100},
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"ok"}
    assert "additionalProperties" not in schema  # the caller's schema is untouched
    opened = SamplingParams(max_tokens=40, temperature=0, logit_bias={comma: 100},
                            structured_outputs=StructuredOutputsParams(json=schema | {"additionalProperties": True}))
    text = llm.generate(["Hello"], opened, use_tqdm=False)[0].text
    assert text.startswith('{"ok": ') and text[len('{"ok": '):].lstrip("truefals").startswith(",")


def test_objects_are_closed_only_where_that_narrows_nothing():
    from shardserve.structured_outputs import bounded_schema

    both = {"allOf": [{"properties": {"a": {}}, "required": ["a"]}, {"properties": {"b": {}}, "required": ["b"]}]}
    assert bounded_schema(both) == both  # closing either branch would refuse every object
    unlisted = {"type": "object", "properties": {"a": {}}, "required": ["a", "z"]}
    assert bounded_schema(unlisted) == unlisted
    nested = bounded_schema({"anyOf": [{"properties": {"o": {"type": "object", "properties": {"q": {}}}}}]})
    assert "additionalProperties" not in nested["anyOf"][0]
    assert nested["anyOf"][0]["properties"]["o"]["additionalProperties"] is False
    StructuredOutputsParams(json=both)  # compiles


def test_unbounded_number_cannot_run_away(llm, tiny_model):
    """A number holds at most 18 digits before the point and 10 after (multipleOf 1e-10), so a model pushed to
    repeat a digit, and to take the point when it may, still closes the object; the schema's own multipleOf
    replaces the step."""
    tok = load_tokenizer(resolve_checkpoint(tiny_model("llama")[0]))
    (one,) = tok.encode("1", add_special_tokens=False)
    (point,) = tok.encode(".", add_special_tokens=False)
    bias = {one: 100, point: 50}

    def number(spec: dict) -> str:
        schema = {"type": "object", "properties": {"v": spec}, "required": ["v"]}
        params = SamplingParams(max_tokens=60, temperature=0, logit_bias=bias,
                                structured_outputs=StructuredOutputsParams(json=schema))
        out = llm.generate(["Hello"], params, use_tqdm=False)[0]
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["v"], float), out.text
        return out.text.removeprefix('{"v": ').removesuffix("}")

    assert number({"type": "number"}) == "1" * 18 + "." + "1" * 10
    assert number({"type": "number", "multipleOf": 0.01}) == "1" * 18 + ".11"
