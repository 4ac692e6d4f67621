"""The offline API, in vLLM's shape: `LLM(...).generate(...)` and `LLM(...).chat(...)`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

from shardserve.config import EngineConfig
from shardserve.core import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from shardserve.distributed.layout import Layout
from shardserve.engine_backends import LocalBackend, ProcessBackend
from shardserve.ipc.messages.api import TokenOut
from shardserve.ipc.secure import deployment_secret
from shardserve.launch.checks import check_dense, check_deployment
from shardserve.launch.deployment import Deployment
from shardserve.launch.grid import run_other_node
from shardserve.launch.nodes import NodeSpec
from shardserve.llm_inputs import (
    Prompt,
    as_params_list,
    as_prompt_list,
    with_loras,
    with_priorities,
)
from shardserve.llm_outputs import Sample, collect, request_output
from shardserve.llm_prompts import PromptEncoder
from shardserve.loader.generation_config import generation_defaults
from shardserve.loader.lora import base_shapes, read_adapter
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.pooling import pooling_of
from shardserve.loader.tokenizer import load_tokenizer
from shardserve.loader.weights import read_model_config, resolve_dtype
from shardserve.logs import use_log_level
from shardserve.router.policy import resolve_policy
from shardserve.sampling_params import LoRARequest, SamplingParams
from shardserve.scheduler.startup import startup_summary, use_threads
from shardserve.tokenizer.image_prompt import image_prompt

log = logging.getLogger(__name__)


class LLM:
    """An engine driven from this process. Keyword arguments are EngineConfig fields (dtype,
    page_size, pp_layer_partition, pp_micro_batches, speculative_config={...} as vLLM takes it,
    ...); `tp_size=T` and `pp_size=P` run the
    model over T x P scheduler processes (P pipeline stages of T tensor ranks); `dp_size=D` runs D
    such replicas behind a router (`load_balance_method`: cache_aware, least_load, round_robin); `ep_size=E`
    splits MoE experts over E ranks with all-to-all dispatch (E = tp_size for now); `cp_size=C`
    spreads each prompt's tokens and KV pages over C ranks (context parallelism, x tp_size);
    `enable_dp_attention=True` (with dp_size=D) runs attention in D lockstep replicas of tp_size / D
    ranks and the MoE layers expert-parallel over all tp_size ranks (SGLang's meaning); `isolated=True`
    uses a scheduler process even for one rank (as the server does). `generation_config` says
    where `generate(prompts)` without SamplingParams takes its defaults: 'auto' (the model's),
    'none', or a directory with a generation_config.json. `threads`: CPU threads per rank;
    `log_level`: debug, info, warning or error, for this process and the workers it starts."""

    def __init__(self, model: str | None = None, tp_size: int = 1, pp_size: int = 1, dp_size: int = 1,
                 ep_size: int = 1, cp_size: int = 1, enable_dp_attention: bool = False,
                 load_balance_method: str | None = None, isolated: bool = False,
                 generation_config: str = "auto", nnodes: int = 1, node_rank: int = 0, dist_init_addr: str = "",
                 dist_secret_file: str | None = None, distributed_executor_backend: str = "local",
                 ray_address: str = "", log_level: str | None = None,
                 startup_timeout: float = 600.0, pooling: str | None = None, **kwargs):
        if log_level is not None:  # this process's and its workers'; no load bar above info
            use_log_level(log_level)
            kwargs.setdefault("show_progress", log_level in ("debug", "info"))
        check_dense(model, ep_size)
        self.layout = Layout.from_sizes(tp=tp_size, pp=pp_size, dp=dp_size, ep=ep_size, nnodes=nnodes,
                                        dp_attention=enable_dp_attention, cp=cp_size)
        policy = resolve_policy(load_balance_method, dp_size, enable_dp_attention)
        self.node = NodeSpec(node_rank, dist_init_addr, deployment_secret(dist_secret_file, node_rank == 0),
                             distributed_executor_backend, ray_address)
        if kwargs.get("pp_layer_partition") is not None:
            kwargs["pp_layer_partition"] = tuple(kwargs["pp_layer_partition"])
        if kwargs.get("disaggregation_mode", "null") != "null":
            raise ValueError("disaggregation_mode is for servers (`shardserve serve --disaggregation-mode ...` "
                             "behind `shardserve router --prefill .. --decode ..`), not the offline LLM")
        ckpt = resolve_checkpoint(model)
        config = EngineConfig(model=model, **kwargs)
        check_deployment(Deployment(config, self.layout, self.node), ckpt)  # as the server checks it
        self.config = resolve_dtype(config, ckpt)
        self._backend = None
        if node_rank > 0:
            # Another machine's share of the grid: serve its ranks until node 0 shuts down.
            self.exit_code = run_other_node(self.config, self.layout, self.node, ckpt.name, startup_timeout)
            return
        self._lora_base = base_shapes(read_model_config(ckpt)) if self.config.enable_lora else None
        self.generation_defaults, _ = generation_defaults(ckpt, generation_config)
        self.pooling = pooling_of(ckpt, pooling)
        self.tokenizer = load_tokenizer(ckpt)
        tok = self.tokenizer
        if self.layout.world > 1 or isolated or self.node.executor == "ray":  # ray: the rank runs on the cluster
            self._backend = ProcessBackend(self.config, self.layout, self.node, ckpt.name, startup_timeout, policy)
        else:
            use_threads(self.config.threads)
            self._backend = LocalBackend(self.config, self._decode if tok else None, tok)
            log.info("%s", startup_summary(self._backend.engine))  # as a server's rank 0 says it
        self._prompts = PromptEncoder(tok, image_prompt(tok, ckpt), self._backend.limits.images_refused)
        self._next_id = 0

    @property
    def engine(self):
        """The in-process EngineCore (one rank only)."""
        backend = self._live()
        if not isinstance(backend, LocalBackend):
            raise RuntimeError("with more than one rank the engine runs in other processes")
        return backend.engine

    def _live(self):
        if self._backend is None:
            if self.node.node_rank > 0:
                raise RuntimeError(f"this LLM ran node {self.node.node_rank}'s ranks; generate on node 0")
            raise RuntimeError("this LLM has been shut down")
        return self._backend

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string, token ids, or vLLM's dict: {"prompt": text} or
        {"prompt_token_ids": ids}, with "multi_modal_data": {"image": PIL images} for a model that
        reads images); outputs keep the input order.
        `lora_request`: the adapter every prompt runs with, or one per prompt (None: the base
        model); the LLM needs enable_lora=True. `priority`: one per prompt, lower first (the LLM
        needs scheduling_policy="priority")."""
        backend = self._live()
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = with_loras(as_params_list(sampling_params, len(prompts)), lora_request)
        params = with_priorities(params, priority)
        encoded = [self._prompts.prepare(p, sp) for p, sp in zip(prompts, params)]
        for enc, sp in zip(encoded, params):
            backend.limits.check(enc.token_ids, sp, enc.images)  # refuse the batch before anything starts
        self._check_loras(params)
        groups = [[self._sample(sp, i) for i in range(sp.n)] for sp in params]
        # All at once: the engine admits the whole batch before its first step, so a run is
        # the same steps every time.
        backend.add([(s.rid, enc.token_ids, s.params, enc.images) for enc, g in zip(encoded, groups) for s in g])
        collect(backend, groups, use_tqdm)
        return [request_output(enc.text, enc.token_ids, g, self._decode) for enc, g in zip(encoded, groups)]

    def _check_loras(self, params: list[SamplingParams]) -> None:
        """Every adapter the batch names, checked before any of it starts (the engine checks again)."""
        loras = {p.lora_request for p in params if p.lora_request is not None}
        if loras and self._lora_base is None:
            raise ValueError(f"LoRA adapter {next(iter(loras)).lora_name!r} asked for, but this LLM serves none: "
                             "make it with enable_lora=True")
        for lora in loras:
            read_adapter(lora.lora_name, lora.lora_path, self._lora_base, self.config.max_lora_rank)

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (self.pooling: the last token's or the mean of the prompt's final
        hidden states, normalized where the model is; `dimensions` truncates a Matryoshka model's)."""
        pool = self.pooling
        if pool.mode is None:
            raise ValueError(pool.why_not)
        if dimensions is not None and (why := pool.check_dimensions(dimensions, self.limits.hidden_size)):
            raise ValueError(why)
        outs = self.generate(prompts, SamplingParams(max_tokens=1, temperature=0, pooling=pool.mode), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(pool.finish(o.embedding, dimensions))) for o in outs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             tools: list[dict] | None = None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, lora_request: LoRARequest | None = None):
        """One conversation returns one RequestOutput; a list of conversations returns a list.
        `tools` (OpenAI's function definitions) are rendered by the model's chat template, as
        vLLM's LLM.chat does; the output is the model's text (parse it with
        server.tool_parsers, or serve with --tool-call-parser). The template options are vLLM's:
        a Jinja `chat_template` in place of the model's, variables it reads, and whether the
        prompt opens the answer or continues the conversation's last (assistant) message.
        `lora_request`: the adapter every conversation runs with (enable_lora=True)."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs}
        prompts = [self._prompts.chat(c, tools, options) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return outs[0] if single else outs

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (temperature, top_p, ...) applied."""
        return SamplingParams(**self.generation_defaults)

    def render_chat(self, conversation: list[dict], tools: list[dict] | None = None,
                    options: dict | None = None) -> list[int]:
        """The conversation's prompt tokens: messages in OpenAI's shapes (text parts, tool calls,
        tool results) normalized and rendered as the server does (chat_messages.py; `options`:
        its chat template options, None values left out)."""
        return self._prompts.chat(conversation, tools, options).token_ids

    def add_request(self, prompt: Prompt, params: SamplingParams) -> str:
        """Queue one request (n must be 1) without waiting; returns its id. Drive with `step`."""
        if params.n != 1:
            raise ValueError("add_request takes n=1; use generate for n > 1")
        enc = self._prompts.prepare(prompt, params)
        self._live().limits.check(enc.token_ids, params, enc.images)
        self._check_loras([params])
        sample = self._sample(params, 0)
        self._live().add([(sample.rid, enc.token_ids, sample.params, enc.images)])
        return sample.rid

    def step(self) -> list[TokenOut]:
        """Progress of every request added with `add_request`: new token ids, finish reasons."""
        return self._live().poll()

    def stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[TokenOut]:
        """One request's progress step by step (new token ids, then the final item)."""
        backend = self._live()
        enc = self._prompts.prepare(prompt, params)
        backend.limits.check(enc.token_ids, params, enc.images)
        self._check_loras([params])
        sample = self._sample(dataclasses.replace(params, n=1), 0)
        backend.add([(sample.rid, enc.token_ids, sample.params, enc.images)])
        done = False
        try:
            while not done:
                for o in backend.poll():
                    if o.rid == sample.rid:
                        done = o.finished
                        yield o
        finally:
            if not done:
                backend.abort(sample.rid)

    def _sample(self, sp: SamplingParams, index: int) -> Sample:
        """The index-th of a prompt's n samples, with its own id and seed, not yet added.
        n samples are n requests sharing the prompt (and, through the prefix cache, its KV);
        only the first scores the prompt: RequestOutput reports it once."""
        one = dataclasses.replace(sp, n=1, seed=sp.sample_seed(index),
                                  prompt_logprobs=sp.prompt_logprobs if index == 0 else None)
        self._next_id += 1
        return Sample(str(self._next_id), one)

    @property
    def limits(self):
        """What a request must fit (vocabulary, context, KV pages)."""
        return self._live().limits

    @property
    def worker_info(self) -> dict[str, dict]:
        """Each scheduler rank's start-up report (e.g. peak_load_rss_mb), by process name."""
        return self._live().infos

    def stats(self):
        """Engine counters: steps, KV pages, and (rank 0's) traffic on the TP and control groups."""
        return self._live().stats()

    def rank_reports(self) -> list[dict]:
        """Every rank's collective counts, by group kind then operation (see bench dist)."""
        return self._live().rank_reports()

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()
            self._backend = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
