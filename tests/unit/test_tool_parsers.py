"""Tool-call parsers: the whole parse and the stream agree for every split of the output into deltas."""

from __future__ import annotations

import json
import random

import pytest

from shardserve.server.tool_parsers import get_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NESTED = ('{"name": "search", "arguments": {"q": "a \\"quoted\\" } brace { and \\\\ <tool_call>", '
          '"filters": [{"k": 1}, [2, 3.5e1]], "deep": {"x": {"y": null}}, "ok": true}}')
W_ARGS = '{"city": "Paris", "unit": "celsius"}'
N_ARGS = NESTED[NESTED.index('"arguments": ') + 13:-1]
W, N = ("get_weather", W_ARGS), ("search", N_ARGS)
HERMES = {
    "one call": (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [W]),
    "text before": (f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.",
                    [W]),
    "two calls": (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{NESTED}\n</tool_call>", None,
                  [W, N]),
    "text after": (f"<tool_call>{WEATHER}</tool_call>\n\nDone.  ", "Done.  ", [W]),
    "name last, no args": ('<tool_call>\n{"arguments": {"a": [1]}, "name": "f"}\n</tool_call>\n'
                           '<tool_call>{"name": "g"}</tool_call>', None, [("f", '{"a": [1]}'), ("g", "{}")]),
    "string arguments": ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
                         [("f", '{"a": 1}')]),
    "string arguments, not an object": ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
                                        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    "compact, unicode": ('<tool_call>{"name":"f","arguments":{"city":"Zürich \\u00e9","n":-1.5e-3}}</tool_call>',
                         None, [("f", '{"city":"Zürich \\u00e9","n":-1.5e-3}')]),
    "no call": ("Paris is the capital. <tool is a word\n", "Paris is the capital. <tool is a word\n", []),
    "empty": ("", None, []),
    "partial tag at the end": ("Hi <tool_ca", "Hi <tool_ca", []),
    "not json": ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    "no name": ('x <tool_call>{"arguments": {}}</tool_call>', 'x <tool_call>{"arguments": {}}</tool_call>', []),
    "name not a string": ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                          '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    "bad then good": (f'A <tool_call>{{oops</tool_call> B <tool_call>{WEATHER}</tool_call> C',
                      "A <tool_call>{oops</tool_call> BC", [W]),
    "truncated before arguments": ('<tool_call>\n{"name": "get_weather", "argu',
                                   '<tool_call>\n{"name": "get_weather", "argu', []),
    "close tag missing": (f"<tool_call>\n{WEATHER}", None, [W]),
}
LLAMA = {
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
                 [("get_weather", '{"city": "Paris"}')]),
    "python tag, arguments key": ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    "several": (f' {WEATHER}; {NESTED} ;{{"name": "g", "parameters": {{}}}}', None,
                [W, N, ("g", "{}")]),
    "trailing text": (f"{WEATHER}\n and then some", "and then some", [W]),
    "trailing semicolon": (f"{WEATHER};", None, [W]),
    "call then garbage": (f"{WEATHER}; not json", "not json", [W]),
    "plain text": ("Paris is the capital.", "Paris is the capital.", []),
    "json but not a call": ('{"answer": 42}', '{"answer": 42}', []),
    "not json": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    "whitespace only": ("  \n", "  \n", []),
    "empty": ("", None, []),
}
CASES = [("hermes", k, *v) for k, v in HERMES.items()] + [("llama3_json", k, *v) for k, v in LLAMA.items()]


def stream(parser, pieces: list[str]) -> tuple[str | None, list[dict], list[dict]]:
    """Feeds pieces; returns the content, the calls the deltas add up to, and the deltas."""
    s = parser()
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, calls = "", []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:  # a call's first delta: index, id, type, name, empty arguments
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == "" and tc["function"]["name"]
            calls.append({"name": tc["function"]["name"], "arguments": ""})
        else:
            assert tc["index"] == len(calls) - 1 and set(tc["function"]) == {"arguments"}
            assert tc["function"]["arguments"]
            calls[-1]["arguments"] += tc["function"]["arguments"]
    return content or None, calls, deltas


def splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("kind,case,text,content,calls", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_whole_and_streamed_parses_agree(kind, case, text, content, calls):
    parser = get_parser(kind)
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    want = [{"name": name, "arguments": args} for name, args in calls]
    assert [c["function"] for c in got_calls] == want
    for c in got_calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    for pieces in splits(text, hash(case) % 1000):
        assert stream(parser, pieces)[:2] == (content, want), pieces


def test_arguments_stream_as_they_are_generated():
    """Token by token, the name goes out once complete and the arguments as they come, never a tag."""
    text = f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>"
    s = get_parser("hermes")()
    seen = []
    for ch in text:
        seen.append((ch, s.feed(ch)))
    assert all("<" not in d.get("content", "") for _, ds in seen for d in ds)
    first_call = next(i for i, (_, ds) in enumerate(seen) if any("tool_calls" in d for d in ds))
    assert "".join(ch for ch, _ in seen[:first_call + 1]).endswith('"arguments": {')
    args = [d["tool_calls"][0]["function"]["arguments"] for _, ds in seen for d in ds if "tool_calls" in d]
    assert args[0] == "" and len(args) > 10 and "".join(args) == W_ARGS
    assert s.finish() == []


def test_broken_arguments_after_streaming_do_not_crash():
    """The one divergence: the header and part of the arguments already went out."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call> tail'
    content, calls = get_parser("hermes").parse(text)
    assert content == text and calls == []
    got_content, got_calls, _ = stream(get_parser("hermes"), list(text))
    assert got_calls[0]["name"] == "f" and got_calls[0]["arguments"].startswith('{"a": 1,')
    truncated = f'<tool_call>{WEATHER[:40]}'
    assert get_parser("hermes").parse(truncated) == (truncated, [])
    assert stream(get_parser("hermes"), [truncated])[1] == [{"name": "get_weather", "arguments": '{"c'}]


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("mistral")


@pytest.mark.parametrize("kind", ["hermes", "llama3_json"])
def test_random_outputs_never_crash_and_stream_the_same_for_every_split(kind):
    """Garbled mixtures of tags, JSON pieces and text: no exception, every split of the stream gives the same
    deltas' sum, and every parsed call's arguments are JSON."""
    bits = ["<tool_call>", "</tool_call>", "<tool", "_call>", "\n", " ", "{", "}", "[", "]", '"', "\\", ":", ",", ";",
            '"name"', '"f"', '"arguments"', '"parameters"', '{"a": 1}', "null", "text", "<|python_tag|>", WEATHER]
    rng = random.Random(kind)
    parser = get_parser(kind)
    for _ in range(300):
        text = "".join(rng.choice(bits) for _ in range(rng.randint(0, 14)))
        _, calls = parser.parse(text)
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
        first = stream(parser, [text])[:2]
        for pieces in splits(text, rng.randint(0, 10**6))[:6]:
            assert stream(parser, pieces)[:2] == first, (text, pieces)


TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                "required": ["city"]}},
         {"name": "now"}]


@pytest.mark.parametrize("kind,parallel,text,ok", [
    ("hermes-text", False, "Plain text, < tool_call> and all.\n", True),
    ("hermes-text", False, 'I will. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("hermes-text", False, 'I will. <tool_call>\n{"name": "now", "arguments": 3}\n</tool_call>', False),
    ("hermes-text", False, 'I will. <tool_call>\nnot json', False),
    ("hermes-text", True, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
                          '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("llama3_json-text", True, "Plain text {with braces}", True),
    ("llama3_json-text", True, '{"name": "now", "parameters": {}}', True),
    ("llama3_json-text", True, ' {"answer": 3}', False),
    ("hermes", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
    ("hermes", False, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("hermes", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', False),
    ("hermes", False, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', False),
    ("hermes", False, 'Sure. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', False),
    ("hermes", True, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', True),
    ("hermes", False, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', False),
    ("llama3_json", True, '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     True),
    ("llama3_json", False, '{"name": "get_weather", "arguments": {"city": "Rome"}}', False),
])
def test_grammar_matches_the_parsers_format(kind, parallel, text, ok, tiny_tok):
    """The grammar that enforces tool_choice required / a named function (and strict functions under auto, with
    text) accepts exactly the calls the parser reads back (compact JSON, as structured outputs generate it)."""
    import llguidance
    import llguidance.hf

    tok = llguidance.hf.from_tokenizer(tiny_tok, n_vocab=len(tiny_tok))
    kind, _, free = kind.partition("-")
    grammar = get_parser(kind).grammar(TOOLS, parallel=parallel, text=bool(free))
    grammar = llguidance.grammar_from("grammar", grammar)
    assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert (m.consume_tokens(tiny_tok.encode(text, add_special_tokens=False)) and m.is_accepting()) == ok
    if ok:
        assert len(get_parser(kind).parse(text)[1]) == text.count('"name"')


def chat_request(**fields):
    from shardserve.server.protocol import ChatRequest

    return ChatRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def tool_use(body, parser: str | None, detected: str | None = None, renders_tools: bool = True):
    """What the chat request's tool fields ask for, on a server started with --tool-call-parser `parser`
    whose chat template names `detected`."""
    from shardserve.server.tools import ToolFormat, chat_tool_use

    return chat_tool_use(body, ToolFormat(parser, detected, renders_tools))


OPENAI_TOOLS = [{"type": "function", "function": f} for f in TOOLS]


@pytest.mark.parametrize("fields,parser,param,says", [
    ({"tools": OPENAI_TOOLS}, None, "tools", "--tool-call-parser"),
    ({"tool_choice": "required"}, "hermes", "tool_choice", "needs tools"),
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "gone"}}}, "hermes",
     "tool_choice", "not among the tools"),
    ({"tools": OPENAI_TOOLS + OPENAI_TOOLS[:1]}, "hermes", "tools", "distinct"),
])
def test_tool_requests_refused(fields, parser, param, says):
    from shardserve.server.errors import APIError

    with pytest.raises(APIError) as e:
        tool_use(chat_request(**fields), parser)
    assert e.value.status == 400 and e.value.param == param and says in e.value.message


def test_tool_choice_modes():
    from shardserve.sampling_params import SamplingParams

    assert tool_use(chat_request(), None).parser is None
    none = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice="none"), None)  # no parser needed
    assert none.parser is None and none.tools is None and none.message("<tool_call>") == (
        {"role": "assistant", "content": "<tool_call>"}, False)
    auto = tool_use(chat_request(tools=OPENAI_TOOLS), "hermes")
    assert auto.tools == OPENAI_TOOLS and auto.grammar is None and auto.constrain(SamplingParams()) == SamplingParams()
    two = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "now"}\n</tool_call>'
    message, called = auto.message(two)
    assert called and message["content"] is None and len(message["tool_calls"]) == 2
    one = tool_use(chat_request(tools=OPENAI_TOOLS, parallel_tool_calls=False), "hermes")
    assert len(one.message(two)[0]["tool_calls"]) == 1
    s = one.stream()
    deltas = s.deltas(two, False) + s.deltas("", True)
    assert s.called and {d["tool_calls"][0]["index"] for d in deltas} == {0}
    named = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}),
                     "llama3_json")
    assert named.grammar == get_parser("llama3_json").grammar([TOOLS[1]], parallel=False)
    assert named.constrain(SamplingParams()).structured_outputs.grammar == named.grammar
    required = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice="required"), "hermes")
    assert required.grammar == get_parser("hermes").grammar(TOOLS, parallel=True)
    strict = [{"type": "function", "function": {**TOOLS[0], "strict": True}}]
    assert tool_use(chat_request(tools=strict), "hermes").grammar == get_parser("hermes").grammar(
        [{**TOOLS[0], "strict": True}], text=True)


def test_forced_calls_need_no_parser_and_the_template_names_one():
    """'required' and named calls are a grammar's, so they serve without --tool-call-parser (in the hermes format
    unless the template names another); 'auto' reads calls back with the flag's parser, else the template's."""
    from shardserve.server.tools import ToolFormat

    required = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice="required"), None)
    assert required.grammar == get_parser("hermes").grammar(TOOLS, parallel=True) and required.tools == OPENAI_TOOLS
    assert required.message('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')[1]
    named = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}),
                     None, detected="llama3_json")
    assert named.grammar == get_parser("llama3_json").grammar([TOOLS[1]], parallel=False)
    assert tool_use(chat_request(tools=OPENAI_TOOLS), None, detected="hermes").parser is get_parser("hermes")
    assert tool_use(chat_request(tools=OPENAI_TOOLS), "llama3_json", detected="hermes").parser is get_parser(
        "llama3_json")  # the flag wins
    # A template that cannot show tools: forced calls go on without showing them; 'auto' sends them (the
    # tokenizer refuses them, naming tools, as test_template_without_tools_is_refused shows).
    unseen = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice="required"), None, renders_tools=False)
    assert unseen.tools is None and unseen.grammar == required.grammar
    assert tool_use(chat_request(tools=OPENAI_TOOLS), "hermes", renders_tools=False).tools == OPENAI_TOOLS
    qwen = "{%- if tools %}<tools>{{ tools }}</tools> answer in <tool_call></tool_call>{%- endif %}"
    llama = "{%- if tools %}{{ tools }}{%- endif %}<|start_header_id|>ipython<|end_header_id|><|python_tag|>"
    assert ToolFormat.of(None, qwen, True).parser == "hermes"
    assert ToolFormat.of(None, llama, True).parser == "llama3_json"
    assert ToolFormat.of(None, "{{ messages }}", False).parser is None
    assert ToolFormat.of("llama3_json", qwen, True).parser == "llama3_json"


def test_template_facts(tiny_tok):
    from shardserve.chat_messages import template_facts

    facts = template_facts(tiny_tok)
    assert facts["renders_tools"] and "<tool_call>" in facts["chat_template"]
    tiny_tok.chat_template, saved = "{% for m in messages %}{{ m['content'] }}{% endfor %}", tiny_tok.chat_template
    try:
        assert template_facts(tiny_tok) == {"chat_template": tiny_tok.chat_template, "renders_tools": False,
                                            "prompt_end": "hi"}
    finally:
        tiny_tok.chat_template = saved
    assert template_facts(None) == {"chat_template": "", "renders_tools": False, "prompt_end": ""}


def test_tool_grammar_conflicts_and_bad_schemas():
    from shardserve.sampling_params import SamplingParams
    from shardserve.server.errors import APIError
    from shardserve.structured_outputs import StructuredOutputsParams

    required = tool_use(chat_request(tools=OPENAI_TOOLS, tool_choice="required"), "hermes")
    with pytest.raises(APIError) as e:
        required.constrain(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    assert e.value.param == "tool_choice" and "response_format" in e.value.message
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/nowhere"}}}}}]
    with pytest.raises(APIError) as e:
        tool_use(chat_request(tools=bad, tool_choice="required"), "hermes").constrain(SamplingParams())
    assert e.value.param == "tools" and "cannot be" in e.value.message


def test_template_without_tools_is_refused(tiny_tok):
    """Tools offered to a model whose template ignores them are a 400 naming tools, not silently dropped."""
    from shardserve.tokenizer.worker import Tokenizer, ToolsIgnored

    messages, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": TOOLS[1]}]
    worker = Tokenizer(tiny_tok, None, None)
    with_tools, _ = worker.encode(None, messages, True, tools)
    assert len(with_tools) > len(worker.encode(None, messages, True)[0])
    tiny_tok.chat_template, saved = "{% for m in messages %}{{ m['content'] }}{% endfor %}", tiny_tok.chat_template
    try:
        with pytest.raises(ToolsIgnored, match="does not render tool definitions"):
            worker.encode(None, messages, True, tools)
    finally:
        tiny_tok.chat_template = saved


def test_offline_chat_renders_tools_as_the_server_does(tiny_model):
    """LLM.chat(tools=...) gives the prompt the server's tokenizer worker renders; a template
    without a place for tools refuses them."""
    from shardserve import LLM, SamplingParams
    from shardserve.chat_messages import ToolsIgnored, render_chat

    path, _ = tiny_model("llama")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    convo = [{"role": "user", "content": "weather?"}]
    with LLM(path, num_pages=64, show_progress=False) as llm:
        with_tools, without = llm.render_chat(convo, tools), llm.render_chat(convo)
        assert len(with_tools) > len(without)
        assert llm.tokenizer.decode(with_tools).count("get_weather") == 1
        params = SamplingParams(max_tokens=2, temperature=0)
        assert llm.chat(convo, params, use_tqdm=False, tools=tools).prompt_token_ids == with_tools

    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

        def apply_chat_template(self, messages, tools=None, **_):
            return "".join(m["content"] for m in messages)

    with pytest.raises(ToolsIgnored, match="does not render tool definitions"):
        render_chat(Plain(), convo, tools)


def test_tool_grammars_bound_their_arguments():
    """A forced call's arguments get structured outputs' bounds: an open integer cannot run on, nor extra keys."""
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    grammar = get_parser("hermes").grammar([fn])
    assert '"maximum": 999999999999999999' in grammar and '"additionalProperties": false' in grammar
    assert "additionalProperties" not in fn["parameters"]  # the request's schema is untouched
