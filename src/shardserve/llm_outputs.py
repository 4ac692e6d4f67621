"""What the offline API gives back: each sample rebuilt from the engine's TokenOut stream
(`Sample`), the stream polled until a batch is done (`collect`), and a prompt's samples put
together as one RequestOutput (`request_output`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from shardserve.core import CompletionOutput, RequestOutput
from shardserve.ipc.messages.api import TokenOut
from shardserve.llm_inputs import Prompt
from shardserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardserve.engine_backends import LocalBackend, ProcessBackend

log = logging.getLogger("shardserve.llm")  # the offline API's logger (these lines were llm.py's)


@dataclass
class Sample:
    """One running sample, rebuilt from the TokenOut stream."""

    rid: str
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] | None = None
    out: TokenOut | None = None  # the final one

    def feed(self, o: TokenOut) -> None:
        self.token_ids.extend(o.new_ids)
        self.logprobs.extend(o.logprobs or [])
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        if o.finished:
            self.out = o


def collect(backend: LocalBackend | ProcessBackend, groups: list[list[Sample]], use_tqdm: bool) -> None:
    """Poll the backend until every sample of every group (a prompt's n samples) has finished;
    on an error or Ctrl-C, abort the ones still running."""
    by_rid = {s.rid: (gi, s) for gi, g in enumerate(groups) for s in g}
    left = [len(g) for g in groups]
    with tqdm(total=len(groups), desc="Generating", disable=not use_tqdm, unit="prompt") as bar:
        try:
            while by_rid:
                for o in backend.poll():
                    entry = by_rid.get(o.rid)
                    if entry is None:
                        continue
                    gi, sample = entry
                    sample.feed(o)
                    if o.finished:
                        del by_rid[o.rid]
                        left[gi] -= 1
                        bar.update(left[gi] == 0)
        finally:
            for rid in by_rid:  # an error or Ctrl-C: free what is still running
                backend.abort(rid)


def request_output(prompt: Prompt, ids: list[int], samples: list[Sample],
                   decode: Callable[[list[int], bool], str]) -> RequestOutput:
    """One prompt's finished samples as its RequestOutput (`decode`: token ids -> text)."""
    comps = []
    for i, s in enumerate(samples):
        text = decode(s.token_ids, s.params.skip_special_tokens)
        if s.out.text_cut is not None:
            text = text[: s.out.text_cut]
        if s.out.error is not None:
            log.warning("request %s failed alone: %s", s.rid, s.out.error)
        comps.append(CompletionOutput(i, text, s.token_ids, s.out.finish_reason, s.out.stop_reason,
                                      s.logprobs if s.params.logprobs is not None else None, s.out.error))
    return RequestOutput(samples[0].rid, prompt if isinstance(prompt, str) else None, ids, comps,
                         samples[0].out.cached_tokens, samples[0].prompt_logprobs, samples[0].out.embedding)
