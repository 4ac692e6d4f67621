"""PEFT adapters for the tiny models, and PEFT's own greedy tokens and logprobs: the oracle of
tests/*/test_lora*.py."""

from __future__ import annotations

import copy

import torch

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (seed, r, lora_alpha, target modules, use_rslora): full, partial, rsLoRA, a third.
ADAPTERS = {
    "full": (1, 4, 8, ALL, False),
    "part": (2, 8, 4, ("q_proj", "v_proj", "down_proj"), True),
    "mlp": (3, 2, 16, ("gate_proj", "up_proj", "down_proj", "o_proj"), False),
}


def save_adapter(base: torch.nn.Module, path: str, seed: int, r: int, alpha: float, targets, rslora: bool):
    """A PEFT LoRA adapter of `base` with random A and B (B scaled so the adapter moves the
    tokens), saved as PEFT saves it; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets if isinstance(targets, str) else list(targets),
                     init_lora_weights=False,
                     use_rslora=rslora)
    model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4)
    model.save_pretrained(path)
    return model.eval()


def peft_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob, recomputed over the whole sequence every step."""
    ids, toks, lps = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            t = int(lp.argmax())
            toks.append(t)
            lps.append(float(lp[t]))
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
    return toks, lps


def logprobs_of(completion) -> list[float]:
    return [d["logprob"] for d in completion.logprobs]


def adapter_set(tiny_model, root, prompts: list[list[int]], new: int, kind: str = "llama"):
    """(base dir, {name: LoRARequest}, {name: PEFT's (tokens, logprobs) per prompt}) for every
    adapter of ADAPTERS on the tiny model `kind`, 'base' (no adapter) among the references."""
    from shardserve import LoRARequest

    path, base = tiny_model(kind)
    reqs, ref = {}, {"base": [peft_greedy(base, p, new) for p in prompts]}
    for i, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        model = save_adapter(base, str(root / name), *spec)
        reqs[name] = LoRARequest(name, i, str(root / name))
        ref[name] = [peft_greedy(model, p, new) for p in prompts]
    return path, reqs, ref


def check_outputs(outs, names: list[str], ref: dict, prompts: list[list[int]]) -> None:
    """Output k ran prompts[k % len(prompts)] under adapter names[k]: PEFT's tokens and logprobs."""
    import pytest

    for k, o in enumerate(outs):
        name, p = names[k], k % len(prompts)
        toks, lps = ref[name][p]
        assert o.outputs[0].token_ids == toks, (name, p)
        assert logprobs_of(o.outputs[0]) == pytest.approx(lps, abs=1e-4), (name, p)
