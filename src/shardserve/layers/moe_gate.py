"""The MoE gate: a replicated [experts, hidden] projection and the rule that picks each token's
top-k experts and their weights from its logits (model_config.RouterConfig says which rule).

- Qwen-MoE and Mixtral: softmax, top-k (renormalised where the config says so).
- DeepSeek-V2: softmax; with `group_limited_greedy`, only the `topk_group` groups holding the
  highest scores compete; the weights times `routed_scaling_factor`.
- DeepSeek-V3: sigmoid scores; choosing adds `e_score_correction_bias` and ranks groups by their
  two best biased scores; the weights are the unbiased scores, renormalised, then scaled.

DeepSeek's gates run in float32 whatever the model's dtype (their checkpoints keep the gate in
float32, and a bf16 gate would choose other experts for near ties).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.arch_config import RouterConfig
from shardserve.layers.linear import ReplicatedLinear, copy_into, make_param


class MoEGate(ReplicatedLinear):
    def __init__(self, hidden: int, num_experts: int, top_k: int, rule: RouterConfig, dtype, device):
        super().__init__(hidden, num_experts, False, torch.float32 if rule.float32 else dtype, device)
        self.top_k, self.rule, self.num_experts = top_k, rule, num_experts
        self.takes_bf16_rows = not rule.float32
        self.e_score_correction_bias = None
        if rule.correction_bias:
            self.e_score_correction_bias = make_param((num_experts,), torch.float32, device, self._load_bias, [None])

    def _load_bias(self, param, src, shard_id=None) -> None:
        copy_into(param.data, src.read().float(), src.name)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of each token's top-k, both [n, k]; weights in x's dtype."""
        rule = self.rule
        logits = self(x.float() if rule.float32 else x).float()
        scores = logits.sigmoid() if rule.scoring == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if rule.groups != "none":
            choice = self._limit_groups(choice)
        if choice is scores:
            weights, experts = scores.topk(self.top_k, dim=-1)
        else:
            experts = choice.topk(self.top_k, dim=-1)[1]
            weights = scores.gather(1, experts)
        if rule.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if rule.scoring == "sigmoid" else 0.0))
        if rule.scaling != 1.0:
            weights = weights * rule.scaling
        return weights.to(x.dtype), experts

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with every expert outside the token's `topk_group` best groups knocked out
        (V2 zeroes them, as its scores are probabilities; V3 sets -inf)."""
        rule, n = self.rule, choice.shape[0]
        grouped = choice.view(n, rule.n_group, self.num_experts // rule.n_group)
        if rule.groups == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(rule.topk_group, dim=-1)[1], True)
        out = grouped.masked_fill(~keep.unsqueeze(-1), 0.0 if rule.groups == "max" else float("-inf"))
        return out.view(n, self.num_experts)
