"""/v1/embeddings: a decoder model's pooled final hidden states (loader/pooling.py says which), on the
same engine as generation: each input is an engine request that computes its prompt and pools it
(SamplingParams.pooling), batched with whatever else runs."""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import Field

from shardserve.sampling_params import SamplingParams
from shardserve.server.errors import APIError
from shardserve.server.generation import collect
from shardserve.server.protocol import Refusing
from shardserve.server.turns import check_model, check_queue, completion_prompts, fan_out, served_name


class EmbeddingRequest(Refusing):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # an end-user id for abuse monitoring: nothing to do with it here


def _encoded(vec: list[float], fmt: str) -> list[float] | str:
    """OpenAI's base64 form: the float32 values, little-endian."""
    return vec if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


async def embeddings(s, body: EmbeddingRequest) -> dict:
    """`s`: the ServerState."""
    if s.disaggregation_mode != "null":
        raise APIError(400, "embeddings are served by a colocated server, not a prefill or decode instance")
    lora = check_model(s, body.model)
    pool = s.pooling
    if pool.mode is None:
        raise APIError(400, f"this server cannot embed: {pool.why_not}")
    if body.dimensions is not None and (why := pool.check_dimensions(body.dimensions, s.hidden_size)):
        raise APIError(400, why, param="dimensions")
    items = completion_prompts(body.input, "input")
    if len(items) > s.max_prompts:
        raise APIError(400, f"{len(items)} inputs exceed the limit of {s.max_prompts} per request (--max-prompts)",
                       param="input")
    check_queue(s, len(items))
    reqs = fan_out(items, SamplingParams(max_tokens=1, temperature=0, pooling=pool.mode, lora_request=lora), 1)
    choices = await collect(s.client, s.metrics, reqs, s.request_timeout)
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(pool.finish(c.embedding, body.dimensions), body.encoding_format)}
            for i, c in enumerate(choices)]
    tokens = sum(c.prompt_tokens for c in choices)
    return {"object": "list", "data": data, "model": served_name(s, lora),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
