"""Runs `shardserve bench offline`'s workload through vLLM: `python vllm_driver.py WORKLOAD RESULT`.

Run by vLLM's own interpreter (`--vllm-python`), in vLLM's virtual environment, so it imports
nothing from shardserve and only the standard library at module level (vllm itself inside `run`:
the pure functions below import and test without it). WORKLOAD is a JSON file:

    {"model": HF_DIR, "dtype": "float32"|"bfloat16", "prompts": [[token ids], ...],
     "output_lens": [n, ...], "max_model_len": null|int, "seed": int,
     "sampling": {"temperature": t, ["top_p": p, "top_k": k, "min_p": m]}}

Every request ignores EOS and makes exactly its n tokens, greedy unless "sampling" gives a
temperature. Sampled requests carry no seed of their own: vLLM 0.32's CPU sampler fails on one
("CPU Generator does not use offset"); LLM(seed=...) makes the run repeatable. After vLLM's start-up and
one short warm-up generation, one `LLM.generate` over all requests is timed (wall_s). RESULT gets
{"wall_s", "startup_s", "prompt_tokens", "output_tokens", "tokens": [[generated ids], ...],
"vllm_version"}. vLLM spawns its workers, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

KEYS = ("model", "dtype", "prompts", "output_lens")
DTYPES = ("float32", "bfloat16")  # what vLLM's CPU backend runs
SAMPLING = ("temperature", "top_p", "top_k", "min_p")
WARMUP_TOKENS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm_driver.py", description=__doc__.splitlines()[0])
    p.add_argument("workload", help="JSON file: the model and requests")
    p.add_argument("result", help="JSON file to write")
    return p.parse_args(argv)


def check_workload(spec: dict) -> dict:
    """`spec` itself if it is a well-formed workload; else ValueError saying what is wrong."""
    missing = [k for k in KEYS if k not in spec]
    if missing:
        raise ValueError(f"workload lacks {', '.join(missing)}")
    if spec["dtype"] not in DTYPES:
        raise ValueError(f"dtype {spec['dtype']!r}: vLLM's CPU backend runs {' or '.join(DTYPES)}")
    prompts, lens = spec["prompts"], spec["output_lens"]
    if not prompts or len(prompts) != len(lens):
        raise ValueError(f"{len(prompts)} prompts but {len(lens)} output lengths")
    if not all(p and all(isinstance(t, int) and t >= 0 for t in p) for p in prompts):
        raise ValueError("each prompt must be a non-empty list of token ids")
    if not all(isinstance(n, int) and n > 0 for n in lens):
        raise ValueError("each output length must be a positive integer")
    unknown = set(spec.get("sampling") or {}) - set(SAMPLING)
    if unknown:
        raise ValueError(f"sampling: unknown fields {sorted(unknown)}; known: {', '.join(SAMPLING)}")
    return spec


def read_workload(path: str) -> dict:
    with open(path) as f:
        return check_workload(json.load(f))


def write_result(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def sampling_kwargs(n: int, sampling: dict | None = None) -> dict:
    """SamplingParams for exactly n tokens, greedy unless `sampling` says otherwise. No text: our
    engine's step() makes none either."""
    return {"temperature": 0.0, "max_tokens": n, "min_tokens": n, "ignore_eos": True, "detokenize": False,
            **(sampling or {})}


def llm_kwargs(spec: dict) -> dict:
    kw = {"model": spec["model"], "dtype": spec["dtype"], "seed": spec.get("seed", 0)}
    if spec.get("max_model_len"):
        kw["max_model_len"] = spec["max_model_len"]
    if spec.get("enforce_eager"):
        kw["enforce_eager"] = True
    return kw


def summarize(spec: dict, tokens: list[list[int]], wall: float, startup: float, version: str) -> dict:
    return {"wall_s": wall, "startup_s": startup, "prompt_tokens": sum(map(len, spec["prompts"])),
            "output_tokens": sum(map(len, tokens)), "tokens": tokens, "vllm_version": version,
            "eager": bool(spec.get("enforce_eager"))}


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # it is a TypedDict: a plain dict is the same thing
        TokensPrompt = dict  # noqa: N806

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(spec))
    warm = TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])
    llm.generate([warm], SamplingParams(**sampling_kwargs(WARMUP_TOKENS)), use_tqdm=False)
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(**sampling_kwargs(n, spec.get("sampling"))) for n in spec["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return summarize(spec, tokens, wall, startup, getattr(vllm, "__version__", "?"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_result(args.result, run(read_workload(args.workload)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
