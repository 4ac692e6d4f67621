"""The real model through the real stack: server chat answer and the terminal shell."""

from __future__ import annotations

import sys

import openai
import pexpect
from server_util import Server


def test_server_chat_answers_paris(tmp_path):
    server = Server("--kv-cache-memory", "256M", log_path=str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    finally:
        code, left = server.stop()
    assert code == 0 and left == []


def test_chat_shell_answers_and_resets():
    shell = pexpect.spawn(sys.executable, ["-m", "shardserve", "chat", "--kv-cache-memory", "256M"],
                          encoding="utf-8", timeout=120)
    try:
        shell.expect("/reset clears")
        shell.expect("> ")
        shell.sendline("What is the capital of France?")
        shell.expect("Paris")
        shell.expect("> ")
        shell.sendline("/reset")
        shell.expect(r"\(conversation cleared\)")
        shell.expect("> ")
        shell.sendline("/exit")
        shell.expect(pexpect.EOF)
    finally:
        shell.close(force=True)
    assert shell.exitstatus == 0


def test_chat_shell_at_tp2_on_a_tiny_model(tiny_model):
    path, _ = tiny_model("llama")
    shell = pexpect.spawn(sys.executable, ["-m", "shardserve", "chat", "--model", path, "--tp-size", "2",
                                           "--num-pages", "64", "--max-tokens", "8"], encoding="utf-8", timeout=120)
    try:
        shell.expect("> ")
        shell.sendline("Hello, how are you?")
        shell.expect("\r\n> ")  # the (8-token) reply streamed, then a new prompt
        shell.sendline("/exit")
        shell.expect(pexpect.EOF)
    finally:
        shell.close(force=True)
    assert shell.exitstatus == 0
