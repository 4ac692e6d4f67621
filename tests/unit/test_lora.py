"""Multi-LoRA in one process against PEFT: each adapter's greedy tokens and logprobs, a batch
mixing adapters and the base model, slots evicted least recently used, the prefix cache kept apart
per adapter, the grouped products' C and torch paths, and every bad adapter refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from lora_util import adapter_set, check_outputs

from shardserve import LLM, LoRARequest, SamplingParams
from shardserve.layers.lora import LoraRows, LoraStep, LoraWeights
from shardserve.loader.lora import BaseShapes, module_shapes, read_adapter

NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=0)
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [200, 1, 2, 3], list(range(40, 75))]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    return adapter_set(tiny_model, tmp_path_factory.mktemp("adapters"), PROMPTS, NEW)


def check(outs, names, ref, prompts=PROMPTS):
    check_outputs(outs, names, ref, prompts)


def test_each_adapter_and_a_mixed_batch_equal_peft(adapters):
    path, reqs, ref = adapters
    with LLM(path, enable_lora=True, max_loras=3, max_lora_rank=8, num_pages=128, show_progress=False) as llm:
        # Alone: each adapter's batch of prompts (and the base model's).
        for name in ("base", *reqs):
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs.get(name))
            check(outs, [name] * len(PROMPTS), ref)
        # Mixed: three adapters and the base in one batch, each prompt under each.
        names = [n for n in ("base", *reqs) for _ in PROMPTS]
        loras = [reqs.get(n) for n in names]
        worker, slots_seen = llm.engine.worker, []
        execute = worker.execute
        worker.execute = lambda plan: slots_seen.append({e.lora_slot for e in plan.entries}) or execute(plan)
        outs = llm.generate(PROMPTS * 4, GREEDY, use_tqdm=False, lora_request=loras)
        check(outs, names, ref)
        # The steps really mixed them: every decode step ran the base and all three slots.
        assert slots_seen[1:NEW - 1] == [{-1, 0, 1, 2}] * (NEW - 2)
        assert llm.engine.loras.loads == 3


def test_lru_eviction_with_more_adapters_than_slots(adapters):
    path, reqs, ref = adapters
    with LLM(path, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8, num_pages=128,
             show_progress=False) as llm:
        names = [n for n in reqs for _ in PROMPTS]
        outs = llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False, lora_request=[reqs[n] for n in names])
        check(outs, names, ref)
        slots = llm.engine.loras
        assert slots.loads == 3  # one slot: each adapter loaded once, its requests run in turn
        assert list(slots.parsed) == [2, 3]  # the ranks keep two parsed: the first was dropped
        # Back to the first: it must be sent again (the ranks dropped it) and still be right.
        outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["full"])
        check(outs, ["full"], ref, PROMPTS[:1])
        assert slots.loads == 4 and list(slots.parsed) == [3, 1]


def test_prefix_cache_is_kept_apart_per_adapter(adapters):
    path, reqs, ref = adapters
    prompt = list(range(100, 180))  # five full pages of 16
    with LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, num_pages=128, show_progress=False) as llm:
        alloc = llm.engine.allocator
        cached = []
        for lora in (reqs["full"], reqs["part"], reqs["full"], None, None):
            out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
            cached.append(out[0].num_cached_tokens)
        # Another adapter's (or the base's) pages are never served; the same adapter's are.
        assert cached == [0, 0, 64, 0, 64]
        roots = {alloc.content[p][0] for p in alloc.content if alloc.content[p][0] in
                 (reqs["full"].cache_root, reqs["part"].cache_root, b"")}
        assert len(roots) == 3


def test_grouped_products_c_and_torch_agree():
    """The C kernel and the torch path of LoraWeights give the same sums, fused pieces included."""
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers import kernels

    if kernels.available() is not None:
        pytest.skip(kernels.available())
    g = torch.Generator().manual_seed(0)
    step = LoraStep()
    pieces = [("q", 0, 0, 24), ("k", 24, 0, 8), ("v", 32, 0, 8)]
    comm = Communicator(None, 0, 1, "tensor", [0])
    w = LoraWeights(step, 3, 4, 16, pieces, comm, False, torch.float32, torch.device("cpu"))
    for slot in range(3):
        for sid, _, _, end in pieces:
            a, b = torch.randn(3, 16, generator=g), torch.randn(end, 3, generator=g)
            w.write(slot, sid, *w.shard(sid, a, b, 0.5))
    x = torch.randn(7, 16, generator=g)
    step.rows = LoraRows.of([2, -1, 0, 2, 1, -1, 0], torch.device("cpu"))
    fast = torch.zeros(7, 40)
    w.add(x, fast)
    slow = torch.zeros(7, 40)
    import shardserve.layers.lora as lora

    real = lora.load_or_none
    lora.load_or_none = lambda: None
    try:
        w.add(x, slow)
    finally:
        lora.load_or_none = real
    assert torch.allclose(fast, slow, atol=1e-5)
    assert fast[1].abs().sum() == 0 and fast[5].abs().sum() == 0  # base rows untouched


BASE = BaseShapes(2, module_shapes(64, 4, 2, 16, 96))


@pytest.mark.parametrize("case, match", [
    ("missing", "is not a directory"),
    ("rank", "rank 8 exceeds --max-lora-rank 4"),
    ("no_weights", "has no adapter_model.safetensors"),
    ("dora", "DoRA is not supported"),
    ("other_base", "is it for another base model"),
    ("save", "modules_to_save"),
])
def test_bad_adapters_refused_in_one_line(adapters, tmp_path, case, match):
    _, reqs, _ = adapters
    src = reqs["part"].lora_path  # rank 8
    path = str(tmp_path / "a")
    if case != "missing":
        shutil.copytree(src, path)
    cfg_path = os.path.join(path, "adapter_config.json")
    max_rank, base = (4 if case == "rank" else 8), BASE
    if case == "no_weights":
        os.remove(os.path.join(path, "adapter_model.safetensors"))
    elif case in ("dora", "save"):
        cfg = json.load(open(cfg_path))
        cfg["use_dora" if case == "dora" else "modules_to_save"] = True if case == "dora" else ["lm_head"]
        json.dump(cfg, open(cfg_path, "w"))
    elif case == "other_base":
        base = BaseShapes(2, module_shapes(32, 4, 2, 8, 96))
    with pytest.raises(ValueError, match=match) as e:
        read_adapter("x", path, base, max_rank)
    assert "\n" not in str(e.value) and "'x'" in str(e.value)


def test_engine_refuses_bad_requests_and_keeps_serving(adapters, tmp_path):
    path, reqs, ref = adapters
    with LLM(path, num_pages=64, show_progress=False) as plain:
        with pytest.raises(ValueError, match="make it with enable_lora=True"):
            plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["full"])
    with LLM(path, enable_lora=True, max_lora_rank=4, num_pages=64, show_progress=False) as llm:
        with pytest.raises(ValueError, match="rank 8 exceeds --max-lora-rank 4"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["part"])
        bad = LoRARequest("gone", 9, str(tmp_path / "nothing"))
        with pytest.raises(ValueError, match="'gone'.*is not a directory"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=bad)
        # A file whose header reads well but whose data is cut short: refused before any rank parses it.
        cut = str(tmp_path / "cut")
        shutil.copytree(reqs["full"].lora_path, cut)
        weights = os.path.join(cut, "adapter_model.safetensors")
        os.truncate(weights, os.path.getsize(weights) - 64)
        with pytest.raises(ValueError, match="'cut': .*runs past the file"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("cut", 10, cut))
        check(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["full"]), ["full"], ref,
              PROMPTS[:1])
        assert llm.engine.loras.wanted == {}  # nothing left held by the refused requests


def test_speculative_decoding_and_structured_outputs_per_adapter(adapters):
    """Prompt-lookup proposals are verified by the target with each request's own adapter (greedy:
    PEFT's tokens and logprobs exactly), and a grammar holds under an adapter."""
    from shardserve.structured_outputs import StructuredOutputsParams

    path, reqs, ref = adapters
    spec = {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, "disable_by_batch_size": 64}
    names = [n for n in ("base", *reqs) for _ in PROMPTS]
    with LLM(path, enable_lora=True, max_loras=3, max_lora_rank=8, num_pages=128, show_progress=False,
             speculative_config=spec) as llm:
        outs = llm.generate(PROMPTS * 4, GREEDY, use_tqdm=False, lora_request=[reqs.get(n) for n in names])
        check(outs, names, ref)
        assert llm.engine.spec.counts.accepted > 0  # proposals were made, and verified under each adapter
        choice = SamplingParams(max_tokens=8, temperature=1.0, seed=3,
                                structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
        outs = llm.generate(["pick"] * 3, choice, use_tqdm=False, lora_request=[reqs["full"], reqs["part"], None])
        assert all(o.outputs[0].text in ("alpha", "beta") for o in outs)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a q/k/v bias, added before the adapters' share
def test_decode_loop_runs_adapters_with_the_modules_arithmetic(tiny_model, tmp_path, kind, monkeypatch):
    """Decode steps with adapter rows run in the C layer loop, bit for bit what the modules compute."""
    from shardserve.layers import decode_loop

    path, reqs, _ = adapter_set(tiny_model, tmp_path, PROMPTS[:2], 1, kind)
    loras = [None, None] + [reqs[n] for n in reqs for _ in PROMPTS[:2]]
    calls, run, applies = [], decode_loop.DecodeLoop.run, decode_loop.DecodeLoop.applies
    monkeypatch.setattr(decode_loop.DecodeLoop, "run", lambda self, x, ctx: calls.append(1) or run(self, x, ctx))
    outs = {}
    for mode in ("loop", "modules"):
        if mode == "modules":
            monkeypatch.setattr(decode_loop.DecodeLoop, "applies", lambda self, x, ctx: False)
        with LLM(path, enable_lora=True, max_loras=3, max_lora_rank=8, num_pages=64, show_progress=False) as llm:
            outs[mode] = llm.generate(PROMPTS[:2] * 4, GREEDY, use_tqdm=False, lora_request=loras)
        if mode == "loop":
            assert len(calls) == NEW - 1  # every decode step, adapter rows and all
    monkeypatch.setattr(decode_loop.DecodeLoop, "applies", applies)
    for a, b in zip(outs["loop"], outs["modules"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [d["logprob"] for d in a.outputs[0].logprobs] == [d["logprob"] for d in b.outputs[0].logprobs]


def test_slot_decisions_replayed_in_order_keep_every_rank_right(adapters):
    """Random arrivals, admissions, ends and plan cuts: a rank applying each plan's lora_ops in
    order always has the adapter a load names, keeps what the leader thinks it keeps, and every
    running request's slot holds its adapter."""
    import random

    from shardserve.ipc.messages.plan import DROP
    from shardserve.loader.lora import base_shapes
    from shardserve.model_config import ModelConfig
    from shardserve.scheduler.lora_slots import LoraSlots
    from shardserve.scheduler.plan_feed import PlanFeed

    path, reqs, _ = adapters
    loras = list(reqs.values()) + [LoRARequest(f"{n}-again", 10 + i, r.lora_path) for i, (n, r) in
                                   enumerate(reqs.items())]
    rng = random.Random(0)
    for slots, cpu in ((1, 1), (1, 2), (2, 2), (2, 3), (3, 6)):
        feed = PlanFeed()
        leader = LoraSlots(slots, cpu, 8, base_shapes(ModelConfig.from_dir(path)), feed)
        parsed, in_slot, running, waiting = set(), {}, [], []
        for _ in range(400):
            roll = rng.random()
            if roll < 0.3:
                lora = rng.choice(loras)
                leader.register(lora)
                waiting.append(lora)
            elif roll < 0.6 and waiting:
                lora = waiting.pop(rng.randrange(len(waiting)))
                slot = leader.acquire(lora)
                if slot is None:
                    waiting.append(lora)
                else:
                    running.append((lora, slot))
            elif roll < 0.85 and running:
                lora, _ = running.pop(rng.randrange(len(running)))
                leader.release(lora)
                leader.unregister(lora)
            else:  # a plan goes out: the rank applies its ops as LoraRuntime.apply does
                for op in feed.plan(0, []).lora_ops:
                    if op.slot == DROP:
                        parsed.discard(op.lora_id)
                        continue
                    assert op.data or op.lora_id in parsed, (slots, cpu)
                    parsed.add(op.lora_id)
                    in_slot[op.slot] = op.lora_id
                assert parsed == set(leader.parsed) and len(parsed) <= cpu
                assert all(in_slot[slot] == lora.lora_int_id for lora, slot in running)


def test_a_waiting_adapter_gets_a_slot_despite_a_steady_stream_of_another(adapters):
    path, reqs, _ = adapters
    short = SamplingParams(max_tokens=3, temperature=0)
    with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_pages=128, show_progress=False) as llm:
        first = [llm.add_request(PROMPTS[0], dataclasses.replace(short, lora_request=reqs["full"])) for _ in range(2)]
        llm.step()
        waiting = llm.add_request(PROMPTS[1], dataclasses.replace(short, lora_request=reqs["part"]))
        done: set[str] = set()
        for _ in range(60):  # a new request of the resident adapter every step
            llm.add_request(PROMPTS[0], dataclasses.replace(short, lora_request=reqs["full"]))
            done |= {o.rid for o in llm.step() if o.finished}
            if waiting in done:
                break
        assert waiting in done and set(first) <= done
        while llm.engine.has_unfinished():
            llm.step()


def test_a_batch_with_a_bad_adapter_is_refused_whole(adapters, tmp_path):
    path, reqs, ref = adapters
    with LLM(path, enable_lora=True, max_lora_rank=8, num_pages=64, show_progress=False) as llm:
        bad = LoRARequest("gone", 9, str(tmp_path / "nothing"))
        with pytest.raises(ValueError, match="'gone'"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[reqs["full"], bad])
        assert llm.engine.requests == {} and llm.engine.loras.wanted == {}
        # One id for two adapters runs neither with the other's weights: the second is refused.
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["full"])
        twin = LoRARequest("twin", reqs["full"].lora_int_id, reqs["part"].lora_path)
        llm.engine.loras.register(reqs["full"])  # held: an adapter the engine still knows by that id
        with pytest.raises(ValueError, match="lora_int_id 1 is already in use by adapter 'full'"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=twin)
        llm.engine.loras.unregister(reqs["full"])
        check(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs["full"]), ["full"], ref,
              PROMPTS[:1])


def test_layouts_without_adapters_refused_at_start(tiny_model):
    from shardserve.config import EngineConfig
    from shardserve.distributed.layout import Layout, LayoutError
    from shardserve.launch.checks import check_lora
    from shardserve.loader.model_path import resolve_checkpoint
    from shardserve.loader.weights import read_model_config

    with pytest.raises(LayoutError, match="--enable-lora is not supported on latent attention"):
        LLM(tiny_model("deepseek_v2")[0], enable_lora=True, num_pages=32, show_progress=False)
    mc = read_model_config(resolve_checkpoint(tiny_model("llama")[0]))
    with pytest.raises(LayoutError, match="--enable-lora is not supported with --disaggregation-mode"):
        check_lora(EngineConfig(enable_lora=True, disaggregation_mode="prefill"), Layout.from_sizes(), mc)


def test_phi3_adapters_on_its_fused_projections_equal_peft(tiny_model, tmp_path):
    """PEFT adapts Phi-3's qkv_proj and gate_up_proj as one matrix each: the engine adapts q, k, v
    and gate, up with the one A and their rows of B; the same tokens and logprobs as PEFT."""
    from lora_util import peft_greedy, save_adapter

    path, base = tiny_model("phi3")
    model = save_adapter(base, str(tmp_path / "phi"), 4, 4, 8, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                         False)
    spec = read_adapter("phi", str(tmp_path / "phi"), BaseShapes(2, module_shapes(64, 4, 2, 16, 96)), 8)
    assert spec.modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ref = {"phi": [peft_greedy(model, p, NEW) for p in PROMPTS], "base": [peft_greedy(base, p, NEW) for p in PROMPTS]}
    assert ref["phi"] != ref["base"]
    with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_pages=64, show_progress=False) as llm:
        lora = LoRARequest("phi", 1, str(tmp_path / "phi"))
        outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    check(outs, ["phi"] * 3 + ["base"] * 3, ref)


def test_gemma3_adapters_equal_peft_in_the_decode_loop(tiny_model, tmp_path, monkeypatch):
    """A PEFT adapter on every projection of Gemma 3 (windowed and full layers, GELU, the norms
    after each block): PEFT's tokens and logprobs, decodes in the C layer loop."""
    from lora_util import peft_greedy, save_adapter

    from shardserve.layers import decode_loop

    path, base = tiny_model("gemma3")
    model = save_adapter(base, str(tmp_path / "g"), 5, 4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"), False)
    prompts = [p * 6 for p in PROMPTS]  # past the 16-token window
    ref = {"g": [peft_greedy(model, p, NEW) for p in prompts], "base": [peft_greedy(base, p, NEW) for p in prompts]}
    assert ref["g"] != ref["base"]
    calls, run = [], decode_loop.DecodeLoop.run
    monkeypatch.setattr(decode_loop.DecodeLoop, "run", lambda self, x, ctx: calls.append(1) or run(self, x, ctx))
    with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_pages=64, show_progress=False) as llm:
        lora = LoRARequest("g", 1, str(tmp_path / "g"))
        outs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    check(outs, ["g"] * 3 + ["base"] * 3, ref)
    assert calls
