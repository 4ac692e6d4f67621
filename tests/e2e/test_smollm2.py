"""The real model through the real stack: the terminal shell. (The server's answer with SmolLM2 is
CI's newcomer check, .ci/newcomer.sh: the README's first command, then the client example.)"""

from __future__ import annotations

import sys

import pexpect


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
