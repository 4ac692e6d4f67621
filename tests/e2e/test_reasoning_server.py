"""--reasoning-parser on chat completions, through the official openai client, on a model that always thinks
"Rome?" and answers "Paris." (scripted_model.py): the thinking comes back as reasoning_content, whole and
streamed, and a structured output holds over the answer only."""

from __future__ import annotations

import json

import openai
import pytest
from scripted_model import save_scripted_model
from server_util import Server, scripted_server
from tiny_tokenizer import CHAT_TEMPLATE

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with scripted_server(tmp_path_factory) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_reasoning_content_whole_and_streamed(client):
    r = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=32)
    message = r.choices[0].message
    assert message.content == "Paris." and message.reasoning_content == "Rome?"
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 9  # 8 tokens and EOS
    chunks = list(client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=32,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert thought == "Rome?" and "".join(d.content or "" for d in deltas) == "Paris."
    kinds = [("r" if getattr(d, "reasoning_content", None) else "c") for d in deltas if d.content or
             getattr(d, "reasoning_content", None)]
    assert kinds == sorted(kinds, reverse=True)  # the thinking streams first, then the answer


def test_structured_output_holds_after_the_thinking(client):
    """The schema binds the answer; the thinking ("Rome?", no JSON) runs as the model wrote it."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=None, messages=ASK, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    message = r.choices[0].message
    assert message.reasoning_content == "Rome?"
    assert json.loads(message.content)["city"] in ("Paris", "Rome") and r.choices[0].finish_reason == "stop"


def test_a_template_that_opens_the_thinking(tmp_path_factory):
    """A Qwen3-Thinking-style template writes <think> into the prompt itself (probed once at start), so the output
    begins inside the thinking; the model writes only "Rome?</think>Paris.". A structured output waits for the
    thinking's end there too."""
    path = str(tmp_path_factory.mktemp("opened"))
    save_scripted_model(path, script="Rome?</think>Paris.", chat_template=CHAT_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"))
    server = Server("--model", path, "--reasoning-parser", "qwen3", "--num-pages", "128", "--page-size", "16",
                    log_path=str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=32)
        assert r.choices[0].message.reasoning_content == "Rome?" and r.choices[0].message.content == "Paris."
        schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
        r = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=32, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        assert r.choices[0].message.reasoning_content == "Rome?"
        assert json.loads(r.choices[0].message.content)["city"] in ("Paris", "Rome")
    finally:
        code, left = server.stop()
    assert left == [] and code == 0, server.read_log()[-3000:]
