"""Tokenizer and detokenizer worker processes.

A tokenizer worker turns GenerateReq (text, token ids or chat messages) into TokenizedReq for
the scheduler and answers /tokenize and /detokenize. The detokenizer turns the scheduler's
TokenBatch into TextBatch for the API. With `--num-tokenizers 0` one process does both jobs,
polling both inboxes.
"""

from __future__ import annotations

import dataclasses
import logging

import zmq

from shardserve.chat_messages import ToolsIgnored, image_urls, render_chat, template_facts
from shardserve.ipc.child import run_child
from shardserve.ipc.messages.api import (
    DetokenizeOut,
    DetokenizeReq,
    ErrorOut,
    GenerateReq,
    TextBatch,
    TokenBatch,
    TokenizedReq,
    TokenizeOut,
    TokenizeReq,
)
from shardserve.ipc.messages.lifecycle import Shutdown
from shardserve.ipc.messages.replicas import DropStreams
from shardserve.ipc.sockets import Endpoints, gate_for, pull, push, recv, send
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.tokenizer import load_tokenizer
from shardserve.multimodal import ImageInput
from shardserve.tokenizer.detokenizer import Detokenizer
from shardserve.tokenizer.image_prompt import ImagePrompt, chat_ids, image_prompt
from shardserve.tokenizer.images import ImageError

log = logging.getLogger(__name__)


class Tokenizer:
    """Owns a tokenizer; every reply goes to the API inbox, every prompt to the scheduler."""

    def __init__(self, tokenizer, to_scheduler: zmq.Socket, to_api: zmq.Socket, images: ImagePrompt | None = None):
        """`images`: how the model's prompts hold images, where it reads them."""
        self.tok, self.to_scheduler, self.to_api, self.images = tokenizer, to_scheduler, to_api, images
        added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        self.think_tokens = {"<think>", "</think>"} <= added  # Qwen3's and R1's tags are tokens

    def encode(self, text: str | None, messages: list[dict] | None, add_special: bool,
               tools: list[dict] | None = None, chat_options: dict | None = None
               ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's token ids, and its images (a chat's image parts) placed on them."""
        if self.tok is None:
            raise ValueError("this model has no tokenizer: send token ids")
        if messages is not None:
            return chat_ids(self.tok, self.images, render_chat(self.tok, messages, tools, chat_options),
                            image_urls(messages))
        return self.tok.encode(text, add_special_tokens=add_special), []

    def tokenized(self, msg: GenerateReq) -> TokenizedReq:
        """The prompt as the engine takes it (`truncate_prompt_tokens`), with `bad_words` as
        token sequences and thinking tags named as tokens where they are (the engine has no
        tokenizer)."""
        params, spec = msg.params, msg.params.structured_outputs
        if spec is not None and spec.thinking_budget is not None and not self.think_tokens:
            raise ValueError("a thinking budget needs <think> and </think> as tokens of the model's vocabulary, "
                             "and this model's tokenizer has no such tokens")
        if spec is not None and spec.thinking is not None and self.think_tokens:
            params.structured_outputs = dataclasses.replace(spec, thinking_tokens=True)
        if params.bad_words:
            if self.tok is None:
                raise ValueError("bad_words need the model's tokenizer")
            params.update_from_tokenizer(self.tok)
        ids, images = (msg.token_ids, []) if msg.token_ids is not None else self.encode(
            msg.text, msg.messages, msg.add_special_tokens, msg.tools, msg.chat_options)
        if images and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        return TokenizedReq(rid=msg.rid, token_ids=params.truncate(ids), params=params,
                            auto_max_tokens=msg.auto_max_tokens, prefill=msg.prefill, images=images)

    def handle(self, msg) -> None:
        try:
            if isinstance(msg, GenerateReq):
                send(self.to_scheduler, self.tokenized(msg))
            elif isinstance(msg, TokenizeReq):
                ids, _ = self.encode(msg.text, msg.messages, msg.add_special_tokens, msg.tools, msg.chat_options)
                send(self.to_api, TokenizeOut(rid=msg.rid, token_ids=ids))
            elif isinstance(msg, DetokenizeReq):
                if self.tok is None:
                    raise ValueError("this model has no tokenizer")
                text = self.tok.decode(msg.token_ids, skip_special_tokens=msg.skip_special_tokens)
                send(self.to_api, DetokenizeOut(rid=msg.rid, text=text))
        except Exception as e:  # a bad prompt must never take the worker down
            param = error_param(e, msg)
            message = f"chat_template: {plain_message(e)}" if param == "chat_template" else plain_message(e)
            send(self.to_api, ErrorOut(rid=msg.rid, message=message, status=400, param=param))


def plain_message(e: Exception) -> str:
    """One line for the client: what went wrong, not which class said so (a template's Jinja
    error keeps its own words, a tokenizer's its own)."""
    return " ".join(str(e).split()) or "the prompt could not be tokenized"


def error_param(e: Exception, msg) -> str | None:
    if isinstance(e, ToolsIgnored):
        return "tools"
    if isinstance(e, ImageError):  # a chat's image part: its URL or its place in the template
        return "messages"
    # Jinja's error in a template the request gave names it (the model's own names nothing).
    own = isinstance(msg, GenerateReq) and (msg.chat_options or {}).get("chat_template") is not None
    return "chat_template" if own and type(e).__module__.startswith("jinja2") else None


def _serve(sockets: dict[zmq.Socket, callable]) -> None:
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll(1000):
            msg = recv(sock, timeout_ms=0)  # None: a malformed message, logged and dropped
            if msg is None:
                continue
            if isinstance(msg, Shutdown):
                return
            sockets[sock](msg)


def tokenizer_main(model: str | None, ep: Endpoints, index: int, detokenize: bool) -> None:
    """Process entry: tokenizer `index`; with `detokenize` it is also the detokenizer."""

    def setup():
        ckpt = resolve_checkpoint(model)
        tok = load_tokenizer(ckpt)
        ctx = zmq.Context.instance()
        to_api = push(ctx, ep.api, ep.secret)
        worker = Tokenizer(tok, push(ctx, ep.scheduler, ep.secret), to_api, image_prompt(tok, ckpt))
        handlers = {pull(ctx, ep.tokenizer(index)): worker.handle}
        if detokenize:
            handlers[detokenizer_inbox(ctx, ep)] = _detok_handler(Detokenizer(tok), to_api)
        return (lambda: _serve(handlers)), template_facts(tok)

    run_child(f"tokenizer-{index}", ep.ready, setup, ep.secret)


def detokenizer_inbox(ctx: zmq.Context, ep: Endpoints) -> zmq.Socket:
    """Where the leaders send tokens: on TCP (ranks placed by Ray) behind this process's ZAP handler."""
    return pull(ctx, ep.detokenizer, ep.secret, gate_for(ctx, ep.secret, ep.detokenizer), "the detokenizer")


def _detok_handler(detok: Detokenizer, to_api: zmq.Socket):
    def handle(msg) -> None:
        if isinstance(msg, TokenBatch):
            items = [detok.feed_safely(o) for o in msg.items if detok.live(o)]
            if items:
                send(to_api, TextBatch(items=items))
        elif isinstance(msg, DropStreams):  # their replica died: no final token will come
            for rid in msg.rids:
                detok.drop(rid)

    return handle


def detokenizer_main(model: str | None, ep: Endpoints) -> None:
    def setup():
        tok = load_tokenizer(resolve_checkpoint(model))
        ctx = zmq.Context.instance()
        handlers = {detokenizer_inbox(ctx, ep): _detok_handler(Detokenizer(tok), push(ctx, ep.api, ep.secret))}
        return (lambda: _serve(handlers)), {}

    run_child("detokenizer", ep.ready, setup, ep.secret)
