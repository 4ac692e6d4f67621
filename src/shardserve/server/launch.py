"""`shardserve serve`: start the process tree, wait for it, then serve HTTP until told to stop.

    API process (this one: FastAPI + uvicorn, EngineClient)
      -> tokenizer-0..N-1   (text -> token ids; chat templates)
      -> scheduler-0        (EngineCore: batching, model, sampling; fans messages out to
           scheduler-1..N-1  the other tensor-parallel ranks, which run in lockstep)
      -> detokenizer        (token ids -> text; in tokenizer-0 when --num-tokenizers 0)
      -> back to the API process

With --nnodes N, this is node 0; `shardserve serve --node-rank K` on another machine runs only
that node's scheduler ranks (launch/nodes.py), no HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys

import uvicorn

from shardserve.chat_messages import TEXT_ONLY
from shardserve.ipc.sockets import Endpoints
from shardserve.launch import LaunchError
from shardserve.launch.checks import bind_socket, check_deployment
from shardserve.launch.deployment import Deployment
from shardserve.launch.grid import LocalGrid, endpoints, place, run_other_node
from shardserve.launch.process_tree import ByName, Child
from shardserve.launch.torchrun import run_rank_here, torchrun_env, torchrun_layout
from shardserve.loader.generation_config import describe, generation_defaults
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.pooling import pooling_of
from shardserve.loader.weights import read_model_config
from shardserve.router.policy import resolve_policy
from shardserve.router.replicas import router_child
from shardserve.server.app import ServerState, build_app
from shardserve.server.client import EngineClient
from shardserve.server.generation import Timeouts
from shardserve.server.lora_registry import LoraRegistry
from shardserve.server.metrics import Metrics
from shardserve.server.reasoning import Reasoning
from shardserve.server.response_store import ResponseStore
from shardserve.server.tools import ToolFormat
from shardserve.tokenizer.images import MediaFetch

log = logging.getLogger("shardserve.launch")


# By name: the API process never imports transformers itself.
tokenizer_main = ByName("shardserve.tokenizer.worker", "tokenizer_main")
detokenizer_main = ByName("shardserve.tokenizer.worker", "detokenizer_main")


def tokenizer_children(model: str | None, ep: Endpoints, num_tokenizers: int) -> list[Child]:
    if num_tokenizers == 0:
        return [Child("tokenizer-0", tokenizer_main, (model, ep, 0, True))]
    return [Child("detokenizer", detokenizer_main, (model, ep))] + [
        Child(f"tokenizer-{i}", tokenizer_main, (model, ep, i, False)) for i in range(num_tokenizers)]


def serve(args: argparse.Namespace, plan: Deployment) -> int:
    """`args`: the server's own flags (host, port, limits); `plan`: what to deploy."""
    ckpt = resolve_checkpoint(plan.engine.model)
    env = torchrun_env()
    if env is not None:  # torchrun started this process as one rank: it decides rank and nodes
        plan = dataclasses.replace(plan, layout=torchrun_layout(plan.layout, env), node=env.node(plan.node.secret))
    check_deployment(plan, ckpt, torchrun=env is not None)
    cfg, layout, node = plan.engine, plan.layout, plan.node
    policy = resolve_policy(args.load_balance_method, layout.dp, layout.dp_attention)
    if env is not None and env.rank > 0:
        return run_rank_here(cfg, layout, env, node.secret)
    if node.node_rank > 0:
        return run_other_node(cfg, layout, node, ckpt.name, args.startup_timeout)
    name = args.served_model_name or ckpt.name.removesuffix(".gguf")
    loras = LoraRegistry.at_start(name, cfg, read_model_config(ckpt), args.lora_modules)
    defaults, origin = generation_defaults(ckpt, args.generation_config)
    log.info(describe(defaults, origin))
    try:
        sock = bind_socket(args.host, args.port)
    except LaunchError as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return 1
    grid = placement = None
    try:
        placement = place(cfg, layout, node, args.startup_timeout)  # with Ray: where each rank runs
        ep = endpoints(layout, node, max(1, args.num_tokenizers), torchrun=env is not None, placement=placement)
        others = tokenizer_children(cfg.model, ep, args.num_tokenizers)
        if layout.dp > 1:
            others.append(router_child(ep, policy, cfg.page_size, cfg.enable_prefix_cache, layout.dp_attention))
        grid = LocalGrid(cfg, layout, node, ep, ckpt.name, others, torchrun=env is not None, placement=placement)
        infos = grid.start(args.startup_timeout)
        info = infos["scheduler-0"] | infos["tokenizer-0"] | {"pooling": pooling_of(ckpt, args.pooling)}
        return run_http(args, name, info, ep, grid, sock, defaults, loras)
    except LaunchError as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if grid is not None:
            grid.stop()
        elif placement is not None:
            placement.release()


class _Server(uvicorn.Server):
    """uvicorn, plus: the first stop signal ends every in-flight request at once with a clean
    error (503, or an error event then [DONE] on a stream), so shutdown does not wait out
    generations nobody will finish, nor cancel handlers mid-await."""

    def __init__(self, config: uvicorn.Config, client: EngineClient):
        super().__init__(config)
        self.client = client
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self._cut_off)
        super().handle_exit(sig, frame)

    def _cut_off(self) -> None:
        if self.client.dead:
            return
        cut = self.client.fail_all("the server is shutting down", status=503)
        log.info("shutting down: %d request%s in flight cut off", cut, "" if cut == 1 else "s")


class _ReplicaEvents:
    """The supervisor's news (from its thread) onto the event loop that owns the client."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: EngineClient, on_failure):
        self.loop, self.client, self.failed = loop, client, on_failure

    def down(self, replicas: tuple[int, ...], reason: str) -> None:
        self.loop.call_soon_threadsafe(self.client.replicas_down, replicas, reason)

    def up(self, replicas: tuple[int, ...], restarts: int) -> None:
        self.loop.call_soon_threadsafe(self.client.replicas_up, replicas, restarts)

    def gave_up(self, replicas: tuple[int, ...], reason: str) -> None:
        self.loop.call_soon_threadsafe(self.client.board.gave_up, replicas, reason)


def run_http(args, name: str, info: dict, ep: Endpoints, grid: LocalGrid, sock: socket.socket,
             sampling_defaults: dict, loras: LoraRegistry) -> int:
    client = EngineClient(ep, max(1, args.num_tokenizers))
    state = ServerState(client, Metrics(), name, info["max_model_len"],
                        max_n=args.max_n, max_queued=args.max_queued_requests, max_body=args.max_body_bytes,
                        sampling_defaults=sampling_defaults, api_key=args.api_key,
                        metrics_require_key=args.metrics_require_key, max_prompts=args.max_prompts,
                        max_stop_strings=args.max_stop_strings, max_stop_length=args.max_stop_length,
                        vocab_size=info.get("limits", {}).get("vocab_size"),
                        tool_format=ToolFormat.of(args.tool_call_parser, info["chat_template"],
                                                  info["renders_tools"]),
                        reasoning=Reasoning.of(args.reasoning_parser, info["prompt_end"]),
                        responses=ResponseStore(args.responses_max_stored, args.responses_max_stored_bytes),
                        request_timeout=Timeouts(total=args.request_timeout),
                        pooling=info["pooling"], hidden_size=info["limits"]["hidden_size"],
                        trust_request_chat_template=args.trust_request_chat_template,
                        disaggregation_mode=args.disaggregation_mode, scheduling_policy=args.scheduling_policy,
                        images_refused=info["limits"].get("images_refused", TEXT_ONLY),
                        media=MediaFetch(args.media_fetch_timeout, frozenset(args.allowed_media_domains)
                                         if args.allowed_media_domains is not None else None),
                        bootstrap_port=args.disaggregation_bootstrap_port or args.port + 1, loras=loras)
    config = uvicorn.Config(build_app(state), log_level=args.log_level, timeout_graceful_shutdown=5)
    server = _Server(config, client)
    failure: list[str] = []

    async def main() -> None:
        loop = server.loop = asyncio.get_running_loop()

        def on_death(reason: str) -> None:  # runs on the watchdog thread
            log.error("%s; shutting down", reason)
            failure.append(reason)
            loop.call_soon_threadsafe(client.fail_all, reason)
            # Give in-flight requests a moment to receive their error, then stop.
            loop.call_soon_threadsafe(loop.call_later, 1.0, setattr, server, "should_exit", True)

        if grid.restartable:  # a dead replica is started again while the others serve
            grid.supervise(_ReplicaEvents(loop, client, on_death), args.replica_restart_limit, args.startup_timeout)
        else:
            grid.watch(on_death)
        log.info("serving %s on http://%s:%d", state.model_name, args.host, args.port)
        await server.serve(sockets=[sock])

    # uvicorn re-raises the stop signal once it has shut down; a no-op handler lets us go on to
    # stop the workers and exit 0 instead of dying by that signal with them still to clean up.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        asyncio.run(main())
    finally:
        client.close()
    return 1 if failure else 0
