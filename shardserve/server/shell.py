"""`shardserve chat`: a terminal chat on an in-process engine, streaming tokens as they come."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from shardserve.core import SamplingParams
from shardserve.llm import LLM
from shardserve.scheduler.process import token_out
from shardserve.server.args import engine_config
from shardserve.tokenizer.detokenizer import Detokenizer

HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) leaves."


def stream_reply(llm: LLM, conversation: list[dict], params: SamplingParams, rid: str):
    """Yield the assistant's reply piece by piece."""
    detok = Detokenizer(llm.tokenizer)
    llm.engine.add_request(rid, llm.render_chat(conversation), params)
    done = False
    while not done:
        for out in llm.engine.step():
            if out.request.request_id == rid:
                msg = detok.feed(token_out(out))
                done = msg.finished
                yield msg.text


def chat(args: argparse.Namespace) -> int:
    cfg = engine_config(args)
    llm = LLM(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    conversation: list[dict] = []
    print(HELP, flush=True)
    turn = 0
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            conversation.clear()
            print("(conversation cleared)", flush=True)
            continue
        if not line:
            continue
        conversation.append({"role": "user", "content": line})
        turn += 1
        reply = ""
        try:
            for piece in stream_reply(llm, conversation, params, f"chat-{turn}"):
                reply += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e} (use /reset)", flush=True)
            conversation.pop()
            continue
        print(flush=True)
        conversation.append({"role": "assistant", "content": reply})
