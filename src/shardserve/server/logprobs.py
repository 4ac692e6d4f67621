"""Logprob entries (the engine's, named by the detokenizer) in the OpenAI and vLLM answer formats.

An entry is {"token_id", "token", "logprob", "top_logprobs": [[id, logprob, text], ...]}, and a
scored prompt token's also has "rank" (engine/sampler.py score_prompt).
"""

from __future__ import annotations


def as_token_ids(lps: list[dict] | None) -> list[dict] | None:
    """vLLM's return_tokens_as_token_ids: every token named "token_id:N", so clients can tell
    apart tokens whose text is the same (or not valid UTF-8 on its own)."""
    if lps is None:
        return None
    return [{**lp, "token": f"token_id:{lp['token_id']}",
             "top_logprobs": [[t[0], t[1], f"token_id:{t[0]}"] for t in lp["top_logprobs"]]} for lp in lps]


def completion_logprobs(lps: list[dict] | None, start: int = 0, k: int | None = None) -> dict:
    """The legacy format keys top_logprobs by token text; where two tokens share a text (partial
    UTF-8), the likelier one's value is kept. Offsets count from `start`: a stream's chunks
    continue where the choice's text so far ends. `k`: at most that many of each top list (a
    prompt scored for prompt_logprobs may hold more than echo's logprobs asked for)."""
    lps = lps or []
    offsets, pos = [], start
    for lp in lps:
        offsets.append(pos)
        pos += len(lp["token"])
    # A prompt's first token has no logprob (nothing precedes it): null, as OpenAI reports it.
    return {"tokens": [lp["token"] for lp in lps], "token_logprobs": [lp["logprob"] for lp in lps],
            "top_logprobs": [_top_by_text(lp, k) for lp in lps], "text_offset": offsets}


def _top_by_text(lp: dict, k: int | None) -> dict | None:
    """The top k, likeliest first, then the sampled (or prompt) token if it is not among them:
    up to k + 1 entries, as OpenAI and vLLM answer (so logprobs 0 gives the token itself)."""
    if lp["logprob"] is None:  # a prompt's first token
        return None
    tops = lp["top_logprobs"][:k] if k is not None else lp["top_logprobs"]
    top: dict[str, float] = {}
    for t in tops:
        top.setdefault(t[2], t[1])
    if not any(t[0] == lp["token_id"] for t in tops):
        top.setdefault(lp["token"], lp["logprob"])
    return top


def _in_top(lp: dict) -> bool:
    return any(t[0] == lp["token_id"] for t in lp["top_logprobs"])


def chat_logprobs(lps: list[dict] | None) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def top(lp: dict) -> list[dict]:
        # top_logprobs 0 asks for none; with k > 0 the sampled token is added when not in the top k.
        out = [entry(t[2], t[1]) for t in lp["top_logprobs"]]
        return out + [entry(lp["token"], lp["logprob"])] if out and not _in_top(lp) else out

    return {"content": [{**entry(lp["token"], lp["logprob"]), "top_logprobs": top(lp)} for lp in lps or []]}


def prompt_logprobs(lps: list[dict] | None, k: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id (a JSON
    string): {"logprob", "rank", "decoded_token"}} for the token itself and the top k."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp["logprob"] is None:
            out.append(None)
            continue
        entry = {str(lp["token_id"]): {"logprob": lp["logprob"], "rank": lp.get("rank"), "decoded_token": lp["token"]}}
        for rank, (tid, value, text) in enumerate(lp["top_logprobs"][:k], 1):
            entry.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out
