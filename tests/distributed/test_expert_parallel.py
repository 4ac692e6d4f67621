"""Expert parallelism (--ep-size): tokens dispatched to the ranks owning their experts and back.

The dispatch on 3 gloo ranks against a one-process reference with exact byte counts (contiguous
experts, and a placement with hot-expert replicas); whole MoE models at EP 2, 3 and 4 equal to
transformers' greedy tokens and log-probabilities; a skewed-router model at EP 2 with 2 replicas
placed from a routing-count file equal to transformers too, and at the layer level its ranks'
expert load more even than without replicas.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from ranks import run_ranks
from tiny_tokenizer import save_tiny_tokenizer

from shardserve import LLM, SamplingParams
from shardserve.config import ModelConfig
from shardserve.distributed.expert_placement import Placement, PlacementPlan, load_counts, max_over_mean, save_counts
from shardserve.layers.expert_dispatch import ExpertDispatch
from shardserve.loader.safetensors_loader import iter_safetensors
from shardserve.loader.weights import load_weights
from shardserve.models.registry import model_class

EXPERTS, TOP_K, HIDDEN = 7, 3, 5  # 7 experts on 3 ranks: 3 + 2 + 2


def routing(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, HIDDEN, generator=g)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)]) if n else \
        torch.zeros(0, TOP_K, dtype=torch.long)
    weights = torch.rand(n, TOP_K, generator=g)
    return x, weights, experts


def expert_fn(e: int, x: torch.Tensor) -> torch.Tensor:
    return x * (e + 1) + e  # distinct per expert, so a token sent to the wrong one shows


# 7 experts on 3 ranks: contiguous (3 + 2 + 2), or with four replicas (experts 0, 1, 5 and 3
# get a second copy), so some tokens choose between copies and some find one on their own rank.
CONTIGUOUS = Placement.contiguous(EXPERTS, 3)
REPLICATED = Placement(EXPERTS, ((0, 1, 2, 5), (3, 4, 0), (5, 6, 1, 3)))


PLACEMENTS = (CONTIGUOUS, REPLICATED)


def dispatch_on_rank(comm) -> list:
    """Per placement: the routed output, this rank's slots, and the all-to-all calls and bytes."""
    tokens = [4, 0, 6][comm.rank]  # rank 1 has no tokens and still joins both all-to-alls
    x, weights, experts = routing(comm.rank, tokens)
    runs = []
    for placement in PLACEMENTS:
        d = ExpertDispatch(comm, EXPERTS, placement)
        slots = d.slots

        def compute(rows, local, w, slots=slots):
            out = torch.zeros_like(rows)
            for i, e in enumerate(slots):
                r, slot = (local == i).nonzero(as_tuple=True)
                out.index_add_(0, r, expert_fn(e, rows[r]) * w[r, slot].unsqueeze(-1))
            return out

        before = copy.copy(comm.traffic["all_to_all"])
        out = d(x, weights, experts, compute)
        after = comm.traffic["all_to_all"]
        runs.append((out, slots, after.calls - before.calls, after.bytes - before.bytes))
    return runs


def chosen_rank(placement: Placement, sender: int, row: int, e: int) -> int:
    """The documented rule: the sender's own copy, else copy (row + sender) mod copies."""
    ranks = [r for r, _ in placement.owners(e)]
    return sender if sender in ranks else ranks[(row + sender) % len(ranks)]


def test_dispatch_and_combine_match_one_process_with_exact_bytes():
    per_rank = run_ranks(dispatch_on_rank, 3)
    assert CONTIGUOUS.slots == ((0, 1, 2), (3, 4), (5, 6))
    for p, placement in enumerate(PLACEMENTS):
        results = [runs[p] for runs in per_rank]
        check_dispatch(placement, results)


def check_dispatch(placement: Placement, results: list) -> None:
    assert [r[1] for r in results] == list(placement.slots)
    row_bytes = (HIDDEN + 2 * TOP_K) * 4
    received = [0, 0, 0]  # rows each rank gets from the others
    sent = [0, 0, 0]
    second_copies = 0
    for rank, (out, _, _, _) in enumerate(results):
        x, weights, experts = routing(rank, [4, 0, 6][rank])
        ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOP_K):
                e = int(experts[t, j])
                ref[t] += weights[t, j] * expert_fn(e, x[t])
        torch.testing.assert_close(out, ref)
        # One row per token per distinct remote destination, however many of its experts go there.
        remote = [{chosen_rank(placement, rank, t, int(e)) for e in experts[t]} - {rank} for t in range(x.shape[0])]
        for dests in remote:
            for d in dests:
                received[d] += 1
        sent[rank] = sum(len(d) for d in remote)
        second_copies += sum(chosen_rank(placement, rank, t, int(e)) != placement.owners(int(e))[0][0]
                             for t in range(x.shape[0]) for e in experts[t])
    # Replicas are used: some pairs went to an expert's second copy (its own rank's, or spread).
    assert (second_copies > 0) == (placement is REPLICATED)
    for rank, (_, _, calls, nbytes) in enumerate(results):
        # Rows sent out, then partials returned to their senders.
        assert (calls, nbytes) == (2, sent[rank] * row_bytes + received[rank] * HIDDEN * 4), rank


NEW = 10
ENGINE = dict(num_pages=64, page_size=8, max_num_batched_tokens=16, show_progress=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=3)


def hf_reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
    return out[0, len(prompt) :].tolist(), torch.log_softmax(logits.float(), -1)


# With test_dp_attention.py (EP 2 and 3 under data-parallel attention offline, EP 4 through the
# server) and the hot-expert test below (EP 2): every size with and without DP attention.
@pytest.mark.parametrize("arch,ep", [("qwen3_moe", 3), ("qwen2_moe", 4)])
def test_ep_matches_transformers(tiny_model, arch, ep):
    path, model = tiny_model(arch)
    g = torch.Generator().manual_seed(4)
    batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 30)]
    with LLM(path, tp_size=ep, ep_size=ep, **ENGINE) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        reports = llm.rank_reports()
    for out, prompt in zip(outs, batch):
        tokens, lps = hf_reference(model, prompt)
        assert out.token_ids == tokens
        for entry, row in zip(out.logprobs, lps, strict=True):
            assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4
    moe_layers = sum(type(m).__name__.endswith("SparseMoeBlock") for m in model.modules())
    for r in reports:  # tokens went to their experts over the expert group, two calls per MoE layer
        calls = r["groups"]["expert"]["all_to_all"]["calls"]
        assert moe_layers and calls > 0 and calls % (2 * moe_layers) == 0


HOT = slice(6, 8)  # experts 6 and 7 (both on rank 1 at EP 2) are made hot in every MoE layer


@pytest.fixture(scope="module")
def skewed_moe(tiny_model, tmp_path_factory):
    """The tiny Qwen3-MoE with experts 6 and 7's router rows scaled (x3), so they win most
    tokens; its routing counts over the test prompts saved as an --ep-expert-placement file; and
    per MoE layer, the inputs the prompts gave it and transformers' outputs for them."""
    _, base = tiny_model("qwen3_moe")
    model = copy.deepcopy(base)
    experts = model.model.layers[0].mlp.gate.weight.shape[0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[HOT] *= 3.0
    path = str(tmp_path_factory.mktemp("skewed_moe"))
    model.save_pretrained(path)
    save_tiny_tokenizer(path, model.config.vocab_size)
    counts = {i: torch.zeros(experts, dtype=torch.long) for i in range(len(model.model.layers))}
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in counts}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def count(mod, args, out, i=i) -> None:  # the router returns (logits, weights, experts)
            counts[i] += torch.bincount(out[2].flatten(), minlength=experts)

        def keep(mod, args, out, i=i) -> None:
            seen[i].append((args[0][0].clone(), out[0].clone()))

        hooks += [layer.mlp.gate.register_forward_hook(count), layer.mlp.register_forward_hook(keep)]
    with torch.no_grad():
        for prompt in skewed_prompts(model):
            model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    counts_path = str(tmp_path_factory.mktemp("placement") / "experts.json")
    save_counts(counts_path, {i: c.tolist() for i, c in counts.items()}, experts, "skewed tiny qwen3_moe")
    layer_io = [(torch.cat([x for x, _ in io]), torch.cat([y for _, y in io])) for io in seen.values()]
    return path, model, counts_path, layer_io


def skewed_prompts(model) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 30)]


def test_ep_with_hot_expert_replicas_matches_transformers(skewed_moe):
    path, model, counts_path, _ = skewed_moe
    batch = skewed_prompts(model)
    with LLM(path, tp_size=2, ep_size=2, ep_num_redundant_experts=2, ep_expert_placement=counts_path,
             **ENGINE) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, prompt in zip(outs, batch):
        tokens, lps = hf_reference(model, prompt)
        assert out.token_ids == tokens
        for entry, row in zip(out.logprobs, lps, strict=True):
            assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4


def moe_layers_on_rank(comm, path: str, plans: list[PlacementPlan], inputs: list[torch.Tensor]) -> list:
    """Per plan: the checkpoint's model built with it and loaded by the real loader, each MoE
    layer run on its recorded inputs (every rank of the tensor group holds the same tokens)."""
    cfg = ModelConfig.from_dir(path)
    runs = []
    for plan in plans:
        model = model_class(cfg.architecture)(cfg, comm, torch.float32, torch.device("cpu"), expert=comm,
                                              placements=plan)
        load_weights(model, iter_safetensors(path), progress=False)
        with torch.inference_mode():
            outs = [layer.mlp(x) for layer, x in zip(model.layers, inputs)]
        moes = [layer.mlp for layer in model.layers]
        runs.append((outs, [m.slots for m in moes], [m.computed for m in moes], [m.routed.clone() for m in moes]))
    return runs


def test_replicas_lower_the_busiest_ranks_expert_load(skewed_moe):
    """At the layer level on 2 gloo ranks: with 2 replicas placed from the counts, every MoE
    layer's output is unchanged and the ranks' computed token-expert pairs are more even."""
    path, model, counts_path, layer_io = skewed_moe
    experts = ModelConfig.from_dir(path).num_experts
    counts = load_counts(counts_path, experts)
    inputs = [x for x, _ in layer_io]
    plans = {"contiguous": PlacementPlan(2), "replicas": PlacementPlan(2, 2, counts.layers)}
    per_rank = run_ranks(functools.partial(moe_layers_on_rank, path=path, plans=list(plans.values()),
                                           inputs=inputs), 2)
    runs = {name: [rank[i] for rank in per_rank] for i, name in enumerate(plans)}
    for layer, (_, ref) in enumerate(layer_io):
        hot = counts.layers[layer]
        assert sum(hot[HOT]) > sum(hot) / 2  # the skew took: two of eight experts get most pairs
        computed = {}
        for name, ranks in runs.items():
            for outs, _, _, _ in ranks:
                torch.testing.assert_close(outs[layer], ref, rtol=1e-4, atol=1e-4)
            # Both ranks of the tensor group route every token: each holds the file's counts.
            assert all(r[3][layer].tolist() == hot for r in ranks)
            computed[name] = [r[2][layer] for r in ranks]
            assert sum(computed[name]) == sum(hot)
        slots = [r[1][layer] for r in runs["replicas"]]
        assert sum(map(len, slots)) == experts + 2
        assert max_over_mean(computed["replicas"]) < max_over_mean(computed["contiguous"]), computed


def test_ep_refusals(tiny_model):
    path, _ = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="--ep-size 2 does not divide the 1 ranks"):
        LLM(path, ep_size=2)
    with pytest.raises(ValueError, match=r"--ep-size 2 must equal --tp-size \(4\)"):
        LLM(path, tp_size=4, ep_size=2)
    with pytest.raises(ValueError, match="--ep-size 2 needs a mixture-of-experts model"):
        LLM(tiny_model("llama")[0], tp_size=2, ep_size=2)
