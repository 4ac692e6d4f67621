"""Flags of `shardserve serve` beyond the engine's."""

from __future__ import annotations

import argparse
import os

from shardserve.cli.flag_types import non_negative_int, port_number, positive_float, positive_int
from shardserve.config import DISAGGREGATION_MODES
from shardserve.openai_errors import API_KEY_ENV
from shardserve.server.reasoning import PARSERS as REASONING_PARSERS
from shardserve.server.tool_parsers import PARSERS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=port_number, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: the file's)")
    g.add_argument("--num-tokenizers", type=non_negative_int, default=1,
                   help="tokenizer workers; 0 = one worker tokenizes and detokenizes")
    g.add_argument("--max-queued-requests", type=positive_int, default=1024,
                   help="requests waiting or running beyond which the server answers 503")
    g.add_argument("--max-n", type=positive_int, default=16, help="largest n a request may ask for")
    g.add_argument("--max-body-bytes", type=positive_int, default=8 * 2**20, help="largest request body")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""),
                   help=f"require 'Authorization: Bearer KEY' on every request but /health and /metrics (default: "
                        f"${API_KEY_ENV}; the environment keeps the key out of `ps`)")
    g.add_argument("--metrics-require-key", action="store_true",
                   help="require the key on /health, /ping and /metrics too")
    g.add_argument("--max-prompts", type=positive_int, default=256, help="largest number of prompts in one request")
    g.add_argument("--max-stop-strings", type=positive_int, default=16, help="most stop strings in one request")
    g.add_argument("--max-stop-length", type=positive_int, default=256, help="longest stop string, in characters")
    g.add_argument("--media-fetch-timeout", type=positive_float, default=5.0,
                   help="seconds to fetch an image given by http(s) URL (a vision-language model's)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="fetch images from these hosts only (default: any host)")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="how the model writes tool calls (hermes: Hermes/Qwen <tool_call> tags; llama3_json: Llama "
                        "3's JSON); default: the one the chat template names, if any. 'auto' tool choice needs "
                        "one; 'required' and named functions are enforced by grammar without")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a thinking model's <think>...</think> off its answer (qwen3, deepseek_r1): "
                        "reasoning_content on chat, reasoning items on responses, thinking blocks on messages")
    g.add_argument("--replica-restart-limit", type=non_negative_int, default=3,
                   help="with --dp-size > 1, times in a row a replica that died is started again (its processes "
                        "afresh, weights reloaded) while the others serve; 0: it stays down. A replica that serves "
                        "5 minutes has its count cleared. The server ends once every replica is down for good")
    g.add_argument("--request-timeout", type=positive_float, default=None,
                   help="seconds a request may run in all; longer, it ends with a 504 (or the stream's error) and "
                        "its pages are freed (default: no limit)")
    g.add_argument("--pooling", choices=("last", "mean"), default=None,
                   help="how /v1/embeddings pools the prompt's final hidden states (default: the checkpoint's "
                        "sentence-transformers config, else the last token, normalized)")
    g.add_argument("--responses-max-stored", type=non_negative_int, default=1024,
                   help="responses kept for GET /v1/responses/{id} and previous_response_id (oldest dropped first)")
    g.add_argument("--responses-max-stored-bytes", type=non_negative_int, default=64 * 2**20,
                   help="bytes of stored responses and their conversations (oldest dropped first)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template that a request sends (a template that loops stalls a tokenizer "
                        "worker, so only trusted clients should reach a server started with this)")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served from the start (PEFT directories), each named as a request's `model` "
                        "names it (needs --enable-lora)")
    g.add_argument("--startup-timeout", type=positive_float, default=300.0,
                   help="seconds to wait for workers to be ready")
    d = p.add_argument_group("disaggregated prefill/decode")
    d.add_argument("--disaggregation-mode", choices=DISAGGREGATION_MODES, default="null",
                   help="prefill: compute prompts for decode instances and ship their KV; decode: have a prefill "
                        "instance compute each prompt, generate the rest (clients go through `shardserve router "
                        "--prefill URL --decode URL`); both need the deployment secret (SHARDSERVE_DIST_SECRET or "
                        "--dist-secret-file) that keys the KV channels")
    d.add_argument("--disaggregation-bootstrap-port", type=port_number, default=None,
                   help="prefill: where decode instances connect; decode: where tensor rank r takes KV, this port + "
                        "r (default: --port + 1)")
    d.add_argument("--disaggregation-timeout", type=positive_float, default=30.0,
                   help="seconds the other instance may say nothing about a request before it is dropped (its pages "
                        "freed, the client told)")


def disaggregation_config(args: argparse.Namespace) -> dict:
    """EngineConfig fields for the disaggregation flags (the KV channels listen on --host)."""
    port = args.disaggregation_bootstrap_port or args.port + 1
    return {"disaggregation_mode": args.disaggregation_mode, "disaggregation_host": args.host,
            "disaggregation_port": port, "disaggregation_timeout": args.disaggregation_timeout}
