"""`shardserve chat`: a terminal chat on an in-process engine, streaming tokens as they come."""

from __future__ import annotations

import sys

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.tokenizer.detokenizer import Detokenizer

HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) leaves."


def stream_reply(llm: LLM, conversation: list[dict], params: SamplingParams):
    """Yield the assistant's reply piece by piece."""
    detok = Detokenizer(llm.tokenizer)
    for out in llm.stream(llm.render_chat(conversation), params):
        yield detok.feed(out).text


def chat(engine: dict, max_tokens: int, temperature: float | None) -> int:
    """`engine`: LLM(...)'s keyword arguments; `temperature` None: the model's default, else greedy."""
    llm = LLM(**engine)
    try:
        return _loop(llm, max_tokens, temperature)
    finally:
        llm.shutdown()


def _loop(llm: LLM, max_tokens: int, temperature: float | None) -> int:
    # Greedy unless the model ships defaults or the user asks; the user's flags win.
    chosen = {"temperature": 0.0, **llm.generation_defaults}
    if temperature is not None:
        chosen["temperature"] = temperature
    params = SamplingParams(**chosen, max_tokens=max_tokens)
    conversation: list[dict] = []
    print(HELP, flush=True)
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
        reply = ""
        try:
            for piece in stream_reply(llm, conversation, params):
                reply += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e} (use /reset)", flush=True)
            conversation.pop()
            continue
        print(flush=True)
        conversation.append({"role": "assistant", "content": reply})
