"""The offline API, in vLLM's shape: `LLM(...).generate(...)` and `LLM(...).chat(...)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from shardserve.config import EngineConfig
from shardserve.core import CompletionOutput, Request, RequestOutput, SamplingParams
from shardserve.loader.tokenizer import load_tokenizer
from shardserve.scheduler.engine_core import EngineCore

Prompt = str | list[int]


class LLM:
    """An engine in this process. Keyword arguments are EngineConfig fields (model, dtype, ...)."""

    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self._core: EngineCore | None = None
        from shardserve.loader.model_path import resolve_checkpoint

        self.tokenizer = load_tokenizer(resolve_checkpoint(model))
        tok = self.tokenizer
        extra_eos = (tok.eos_token_id,) if tok is not None and tok.eos_token_id is not None else ()
        self._core = EngineCore(self.config, decode=self._decode if tok else None, extra_eos=extra_eos)
        self._next_id = 0

    @property
    def engine(self) -> EngineCore:
        if self._core is None:
            raise RuntimeError("this LLM has been shut down")
        return self._core

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (a string or token ids); outputs keep the input order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for ids, sp in zip(encoded, params):
            self.engine.check_request(ids, sp)  # refuse the batch before anything starts
        groups: list[list[Request]] = []
        for ids, sp in zip(encoded, params):
            groups.append([self._add(ids, sp, i) for i in range(sp.n)])
        self._run(groups, use_tqdm)
        return [self._output(p, ids, reqs) for p, ids, reqs in zip(prompts, encoded, groups)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """One conversation returns one RequestOutput; a list of conversations returns a list."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        prompts = [self.render_chat(c) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return outs[0] if single else outs

    def render_chat(self, conversation: list[dict]) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template")
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _add(self, ids: list[int], sp: SamplingParams, index: int) -> Request:
        # n samples are n requests sharing the prompt (and, through the prefix cache, its KV).
        seed = None if sp.seed is None else sp.seed + index
        one = dataclasses.replace(sp, n=1, seed=seed)
        self._next_id += 1
        return self.engine.add_request(str(self._next_id), ids, one)

    def _run(self, groups: list[list[Request]], use_tqdm: bool) -> None:
        pending = {id(r): gi for gi, g in enumerate(groups) for r in g}
        left = [len(g) for g in groups]
        with tqdm(total=len(groups), desc="Generating", disable=not use_tqdm, unit="prompt") as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and id(out.request) in pending:
                        gi = pending.pop(id(out.request))
                        left[gi] -= 1
                        if left[gi] == 0:
                            bar.update(1)

    def _output(self, prompt: Prompt, ids: list[int], reqs: list[Request]) -> RequestOutput:
        comps = []
        for i, r in enumerate(reqs):
            text = self._decode(r.output_token_ids, r.params.skip_special_tokens)
            if r.text_cut is not None:
                text = text[: r.text_cut]
            comps.append(CompletionOutput(i, text, list(r.output_token_ids), r.finish_reason, r.stop_reason,
                                          r.logprobs if r.params.logprobs is not None else None))
        return RequestOutput(reqs[0].request_id, prompt if isinstance(prompt, str) else None, ids, comps,
                             reqs[0].num_cached_tokens)

    def shutdown(self) -> None:
        self._core = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, str | list | tuple):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_params_list(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
    return sp
