"""Images through the server: a chat's image_url parts (data: URLs, or http ones the server fetches)
reach Gemma 3's encoder and give transformers' greedy tokens, streamed or not; /tokenize counts the
image's tokens; a bad image (or one that cannot be fetched) is a 400, and the server serves on."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image
from server_util import Server
from transformers import AutoTokenizer
from vlm_util import hf_greedy, make_vlm, no_placeholder, pixels

from shardserve.tokenizer.images import resize_rgb

NEW = 6


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vlm"))
    model, vision = make_vlm(path)
    server = Server("--model", path, "--num-pages", "64", "--page-size", "4", "--served-model-name", "vlm",
                    "--media-fetch-timeout", "1", "--allowed-media-domains", "127.0.0.1",
                    log_path=str(tmp_path_factory.mktemp("logs") / "server.log"))
    server.model, server.vision, server.tok = model, vision, AutoTokenizer.from_pretrained(path)
    yield server
    code, left = server.stop()
    assert left == [] and code == 0, server.read_log()[-3000:]


def data_url(image: np.ndarray) -> str:
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(image_urls: list[str], text: str = " Describe it.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return [{"role": "user", "content": [{"type": "text", "text": "Look: "}, *parts, {"type": "text", "text": text}]}]


def test_chat_with_images_equals_transformers(vlm_server):
    s = vlm_server
    images = [pixels(11, 70), pixels(12, 40)]
    messages = chat([data_url(im) for im in images])
    ids = httpx.post(s.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids.count(s.vision.image_token_id) == 2 * s.vision.mm_tokens_per_image
    ref, _ = hf_greedy(s.model, ids, [resize_rgb(Image.fromarray(im), s.vision.image_size) for im in images], NEW)
    client = OpenAI(base_url=s.url + "/v1", api_key="none")
    allowed = no_placeholder(s.vision, s.model.config.text_config.vocab_size, NEW).allowed_token_ids
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=NEW, temperature=0,
                                       extra_body={"allowed_token_ids": allowed})
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == NEW
    assert r.choices[0].message.content == s.tok.decode(ref, skip_special_tokens=True)
    stream = client.chat.completions.create(model=None, messages=messages, max_tokens=NEW, temperature=0,
                                            stream=True, extra_body={"allowed_token_ids": allowed})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize("part, param, words", [
    ({"url": "data:image/png;base64,AAAA"}, "messages", "not an image"),
    ({"url": "https://example.com/cat.png"}, "messages", "--allowed-media-domains"),
    ({"url": "file:///etc/passwd"}, "messages", "data: URL or an http(s) one"),
    ({"url": "data:image/png;base64,AAAA", "detail": "low"}, "messages.0.content.1.image_url.detail", "auto"),
])
def test_a_bad_image_is_a_400_and_the_server_serves_on(vlm_server, part, param, words):
    s = vlm_server
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": part}]}]
    client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=None, messages=messages, max_tokens=2)
    err = e.value.body
    assert words in err["message"] and "\n" not in err["message"]
    assert param == "messages" or err["param"] == param
    ok = client.chat.completions.create(model=None, messages=chat([data_url(pixels(3))]), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_responses_and_messages_apis_take_images_as_chat_does(vlm_server):
    """The Responses API's input_image and the Messages API's base64 image block: the chat's tokens."""
    s = vlm_server
    image = pixels(13, 50)
    url = data_url(image)
    chat_text = OpenAI(base_url=s.url + "/v1", api_key="none").chat.completions.create(
        model=None, messages=chat([url]), max_tokens=NEW, temperature=0).choices[0].message.content
    r = httpx.post(s.url + "/v1/responses", json={"max_output_tokens": NEW, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                     {"type": "input_image", "image_url": url, "detail": "auto"},
                                     {"type": "input_text", "text": " Describe it."}]}]}).json()
    assert r["output"][-1]["content"][0]["text"] == chat_text
    data = url.split(",", 1)[1]
    body = {"model": "vlm", "max_tokens": NEW, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}},
                                     {"type": "text", "text": " Describe it."}]}]}
    m = httpx.post(s.url + "/v1/messages", json=body).json()
    assert m["content"][-1]["text"] == chat_text
    count = {"model": "vlm", "messages": body["messages"]}
    counted = httpx.post(s.url + "/v1/messages/count_tokens", json=count).json()
    u = m["usage"]  # (most of the prompt came from the prefix cache: the chat's)
    assert counted == {"input_tokens": u["input_tokens"] + u["cache_read_input_tokens"]} and u["input_tokens"] < 8


@pytest.fixture(scope="module")
def image_host():
    """A local web server: /cat.png an image, /slow.png one that takes 3 s, /page an HTML page."""
    png = io.BytesIO()
    Image.fromarray(pixels(31, 44)).save(png, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/slow.png":
                time.sleep(3)
            body, kind = {"/cat.png": (png.getvalue(), "image/png"), "/slow.png": (png.getvalue(), "image/png"),
                          "/page": (b"<html>hi</html>", "text/html")}.get(self.path, (None, None))
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", kind or "text/plain")
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}", "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    httpd.shutdown()


def test_an_http_image_is_fetched_and_read_as_its_bytes_are(vlm_server, image_host):
    s, (host, same) = vlm_server, image_host
    client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    answers = [client.chat.completions.create(model=None, messages=chat([url]), max_tokens=NEW, temperature=0)
               for url in (f"http://{host}/cat.png", same)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens
    m = httpx.post(s.url + "/v1/messages", json={"model": "vlm", "max_tokens": NEW, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image", "source": {"type": "url", "url": f"http://{host}/cat.png"}},
                                     {"type": "text", "text": " Describe it."}]}]}).json()
    assert m["content"][-1]["text"] == answers[0].choices[0].message.content


@pytest.mark.parametrize("where, words", [
    ("/slow.png", "did not arrive within 1 s"),
    ("/missing.png", "gave HTTP 404"),
    ("/page", "not an image"),
])
def test_an_image_that_cannot_be_fetched_is_a_400(vlm_server, image_host, where, words):
    s, (host, _) = vlm_server, image_host
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": chat([f"http://{host}{where}"]),
                                                          "max_tokens": 2}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and words in err["message"] and err["param"] == "messages", err
    port = host.split(":")[1]  # another name of the same host is not an allowed one
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": chat([f"http://localhost:{port}/cat.png"]),
                                                          "max_tokens": 2})
    assert r.status_code == 400 and "not 'localhost'" in r.json()["error"]["message"]
