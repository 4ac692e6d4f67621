"""Pipeline parallelism end to end: stages in their own processes give transformers' tokens and
log-probabilities, on every architecture, with chunked prefill, prefix hits, preemption, seeded
sampling and prompt logprobs; several micro-batches really are in flight; a dead stage ends the
server whole.

The tiny models have 5 layers, so no stage count tested divides them (PP 2 splits 3 + 2, PP 3
2 + 2 + 1, PP 4 2 + 1 + 1 + 1)."""

from __future__ import annotations

import os
import re
import sys
import time

import httpx
import pytest
import torch
from engine_util import SMOLLM2_QUESTION

from shardserve import LLM, SamplingParams
from shardserve.distributed.layout import LayoutError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import Server, descendants  # noqa: E402

LAYERS, NEW, TOP = 5, 12, 3
# A 16-token step budget cuts the 30-token prompt into chunks on every layout.
ENGINE = dict(num_pages=64, page_size=8, max_num_batched_tokens=16, show_progress=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=TOP)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=5, repetition_penalty=1.2)
SCORED = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (1, 9, 30)]


def hf_reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-probabilities of every generated position."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
    return out[0, len(prompt) :].tolist(), torch.log_softmax(logits.float(), -1)


def assert_logprobs_close(entries: list[dict], ref: torch.Tensor) -> None:
    for entry, row in zip(entries, ref, strict=True):
        assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4
        ids = [i for i, _ in entry["top_logprobs"]]
        got = torch.tensor([v for _, v in entry["top_logprobs"]])
        assert torch.allclose(got, row[ids], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Per architecture: the checkpoint, prompts, transformers' tokens and logprobs, and one rank's
    seeded sample and prompt logprobs."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path, model = tiny_model(arch, LAYERS)
            batch = prompts(model.config.vocab_size)
            hf = [hf_reference(model, p) for p in batch]
            with LLM(path, **ENGINE) as one:
                seeded = one.generate(batch[1:2], SEEDED, use_tqdm=False)[0].token_ids
                scored = one.generate(batch[2:], SCORED, use_tqdm=False)[0].prompt_logprobs
            cache[arch] = (path, batch, hf, seeded, scored)
        return cache[arch]

    return get


LAYOUTS = [(2, 1), (4, 1), (2, 2)]  # (pp, tp); PP 3 (uneven) runs in MATRIX


# TP 2 x PP 2 on a dense and a MoE architecture (Qwen3 is Llama with q/k norms, which shard with
# the heads; Qwen2-MoE's block is Qwen3-MoE's with a shared expert, run here at PP 3); PP 2, 3 and 4
# alone on one dense and one MoE architecture between them (PP 4: in the preemption test below; the
# stage split does not depend on the architecture; CI time).
MATRIX = [("llama", 2, 1), ("llama", 2, 2), ("qwen3_moe", 2, 2), ("qwen2_moe", 3, 1), ("gemma3", 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,pp,tp", MATRIX, ids=[f"{a}-pp{p}-tp{t}" for a, p, t in MATRIX])
def test_pp_matches_transformers(reference, arch, pp, tp):
    path, batch, hf, seeded, scored = reference(arch)
    with LLM(path, pp_size=pp, tp_size=tp, **ENGINE) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        again = llm.generate(batch, GREEDY, use_tqdm=False)  # the prompts' full pages are cached now
        sampled = llm.generate(batch[1:2], SEEDED, use_tqdm=False)[0].token_ids
        prompt_lps = llm.generate(batch[2:], SCORED, use_tqdm=False)[0].prompt_logprobs
        stats = llm.stats()
        layers = [llm.worker_info[f"scheduler-{r}"]["layers"] for r in range(0, pp * tp, tp)]
    for out, (tokens, lps) in zip(outs, hf):
        assert out.token_ids == tokens
        assert_logprobs_close(out.logprobs, lps)
    assert [o.token_ids for o in again] == [t for t, _ in hf]
    assert again[2].num_cached_tokens == 24  # three full pages of the 30-token prompt
    assert sampled == seeded
    assert [e["token_id"] for e in prompt_lps] == [e["token_id"] for e in scored]
    for mine, ref in zip(prompt_lps[1:], scored[1:]):
        assert abs(mine["logprob"] - ref["logprob"]) < 1e-4
    # Three requests spread over the micro-batches, all in flight at once (a prompt's chunks that
    # sample nothing follow each other without waiting, so a fourth can join at PP 4).
    assert min(pp, len(batch)) <= stats.max_in_flight <= pp
    base, extra = divmod(LAYERS, pp)
    counts = [base + (i < extra) for i in range(pp)]
    assert [b - a for a, b in layers] == counts and layers[0][0] == 0 and layers[-1][1] == LAYERS


@pytest.mark.slow
@pytest.mark.parametrize("pp,tp", LAYOUTS, ids=[f"pp{p}-tp{t}" for p, t in LAYOUTS])
def test_pp_preemption_and_layer_partition(reference, pp, tp):
    """A pool too small for every request at once forces preemption mid-pipeline; the tokens stay
    transformers'. At PP 2 an explicit --pp-layer-partition 1,4 is honoured."""
    path, batch, hf, _, _ = reference("llama")
    partition = (1, 4) if (pp, tp) == (2, 1) else None
    with LLM(path, pp_size=pp, tp_size=tp, pp_layer_partition=partition, num_pages=8, page_size=8,
             show_progress=False) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        stats = llm.stats()
        layers = [llm.worker_info[f"scheduler-{r}"]["layers"] for r in range(0, pp * tp, tp)]
    assert [o.token_ids for o in outs] == [t for t, _ in hf]
    assert stats.preemptions > 0
    if partition:
        assert layers == [[0, 1], [1, 5]]


def test_micro_batches_in_flight_against_one(reference):
    """With the default (one micro-batch per stage) two are in flight at once; with
    --pp-micro-batches 1, never more than one. The same tokens either way."""
    path, batch, hf, _, _ = reference("llama")
    seen = {}
    for k in (None, 1):
        with LLM(path, pp_size=2, pp_micro_batches=k, **ENGINE) as llm:
            tokens = [o.token_ids for o in llm.generate(batch * 2, GREEDY, use_tqdm=False)]
            seen[k] = (tokens, llm.stats().max_in_flight)
    assert seen[None][1] == 2 and seen[1][1] == 1
    assert seen[None][0] == seen[1][0] == [t for t, _ in hf] * 2


def test_bad_pipeline_sizes_are_refused_before_any_process_starts(reference, monkeypatch):
    import multiprocessing.process
    import subprocess

    path = reference("llama")[0]
    started: list = []

    def no_process(*args, **kwargs):
        started.append(args)
        raise AssertionError(f"a process was started before the layout was checked: {args}")

    # Every way the launchers start a process (ProcessTree: subprocess.Popen) is a spy that refuses.
    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_process)
    children = descendants(os.getpid())
    with pytest.raises(LayoutError, match="--pp-size 6 exceeds the model's 5 layers"):
        LLM(path, pp_size=6, show_progress=False)
    with pytest.raises(LayoutError, match="--pp-layer-partition 2,2 must be 2 counts"):
        LLM(path, pp_size=2, pp_layer_partition=(2, 2), show_progress=False)
    with pytest.raises(LayoutError, match="--pp-layer-partition 1,1,3 must be 2 counts"):
        LLM(path, pp_size=2, pp_layer_partition=(1, 1, 3), show_progress=False)
    with pytest.raises(LayoutError, match="--pp-micro-batches 2 needs --pp-size > 1"):
        LLM(path, pp_micro_batches=2, show_progress=False)
    assert started == []
    assert descendants(os.getpid()) == children  # and none by another route


def test_dead_stage_ends_the_server_naming_it(reference, tmp_path):
    path = reference("llama")[0]
    server = Server("--model", path, "--pp-size", "2", "--num-pages", "64", "--page-size", "8",
                    log_path=str(tmp_path / "log"))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        # /metrics shows both stages: the first sends the residual stream, the last sends results.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = httpx.get(server.url + "/metrics").text
            if 'group="control",op="result",stage="1"' in metrics:
                break
            time.sleep(0.3)
        sends = re.search(r'shardserve_stage_comm_calls\{group="pipeline",op="send",stage="0"\} (\S+)', metrics)
        assert sends and float(sends.group(1)) >= 4
        assert 'shardserve_stage_comm_calls{group="control",op="result",stage="1"}' in metrics

        assert server.kill_mid_request("scheduler-1") < 30
    finally:
        code, left = server.stop()
    assert code != 0 and left == []
    assert "scheduler-1 (pipeline stage 1 of 2) was killed by signal 9" in server.read_log()


@pytest.mark.slow
def test_smollm2_pp2_answers_paris_with_one_process_tokens(smollm2_path, smollm2_answer):
    """The real model (tied LM head on the last stage) over two stages; offline, as the server's
    path under PP runs on the tiny models above (CI time)."""
    with LLM(smollm2_path, pp_size=2, kv_cache_memory=2**27, show_progress=False) as llm:
        out = llm.chat(SMOLLM2_QUESTION, SamplingParams(max_tokens=16, temperature=0, logprobs=1), use_tqdm=False)
    assert "Paris" in out.text
    assert out.token_ids == smollm2_answer.token_ids
    assert len(out.logprobs) == len(smollm2_answer.token_ids)


def test_pp_n_samples_stop_strings_and_abort(reference):
    """n > 1 with a seed and stop strings give PP 1's outputs; a stream abandoned mid-generation is
    aborted and its pages freed, with a micro-batch possibly in flight."""
    path, batch, _, _, _ = reference("llama")
    n2 = SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=3)
    with LLM(path, **ENGINE) as one:
        ref_n = one.generate(batch[1:2], n2, use_tqdm=False)[0]
        text = one.generate(batch[1:2], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0].text
        stop = SamplingParams(max_tokens=10, temperature=0, stop=[text[3:6]])
        ref_stop = one.generate(batch[1:2], stop, use_tqdm=False)[0]
    with LLM(path, pp_size=2, **ENGINE) as llm:
        got_n = llm.generate(batch[1:2], n2, use_tqdm=False)[0]
        got_stop = llm.generate(batch[1:2], stop, use_tqdm=False)[0]
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        for i, _ in enumerate(llm.stream(batch[2], long)):
            if i == 3:
                break  # leaving the stream aborts the request
        after = llm.generate(batch[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        stats = llm.stats()
    assert [c.token_ids for c in got_n.outputs] == [c.token_ids for c in ref_n.outputs]
    assert got_n.outputs[0].token_ids != got_n.outputs[1].token_ids
    assert (got_stop.text, got_stop.finish_reason) == (ref_stop.text, "stop") and len(got_stop.text) < len(text)
    assert len(after[0].token_ids) == 4
    assert stats.running == stats.waiting == stats.pages_used == 0
