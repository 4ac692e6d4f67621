"""Why a request stops after a new token: a stop token, EOS, a stop string, or its length."""

from __future__ import annotations

from collections.abc import Callable

from shardserve.core import Request
from shardserve.text import IncrementalText, find_stop


def finish_reason(req: Request, tok: int, decode: Callable[[list[int], bool], str] | None,
                  max_model_len: int) -> str | None:
    """"stop", "length" or None for `req`, whose newest token is `tok` (sets its stop_reason and,
    for a stop string, text_cut). Before `min_tokens` output tokens nothing stops it but its
    length (the sampler bans EOS and stop tokens till then; a stop string is not matched)."""
    p = req.params
    early = len(req.output_token_ids) < p.min_tokens
    if tok in p.stop_token_ids and not early:
        req.stop_reason = tok
        return "stop"
    if not p.ignore_eos and tok in req.eos_token_ids and not early:
        return "stop"
    # The text grows with every token (min_tokens or not): a later stop string may begin in it.
    if p.stop and _match_stop_string(req, decode):
        return "stop"
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def _match_stop_string(req: Request, decode) -> bool:
    # Grow the text a token at a time (O(1) per step, not O(output)); a stop string that ends in
    # the new characters may begin in older ones.
    if req.stop_text is None:
        req.stop_text = IncrementalText()
    grew = req.stop_text.add(req.output_token_ids[-1:], decode, req.params.skip_special_tokens)
    hit = find_stop(req.stop_text.text, grew, req.params.stop) if grew else None
    if hit is None or len(req.output_token_ids) < req.params.min_tokens:
        return False
    cut, req.stop_reason = hit
    req.text_cut = cut + len(hit[1]) if req.params.include_stop_str_in_output else cut
    return True
