"""Gemma 3's image encoder: the SigLIP vision tower and Gemma3MultiModalProjector, as transformers
computes them, turning resized RGB images into rows of the text model's embeddings.

The weights are replicated on every tensor-parallel rank. The encoder's `named_parameters()` are the
Hub checkpoints' names (`vision_tower.vision_model.*`, `multi_modal_projector.*`); `vision_weight_name`
maps the other spellings onto them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.arch_config import VisionConfig
from shardserve.layers.linear import copy_into, make_param
from shardserve.loader.source import TensorSource


def vision_weight_name(name: str) -> str | None:
    """A checkpoint tensor's name as the encoder's parameter, or None if the encoder does not take it.
    Hub files say `vision_tower.vision_model.*`; transformers 5 names its modules `model.vision_tower.*`
    and saves `vision_tower.*` without `vision_model.`. SigLIP's pooling head (`vision_use_head`) is
    not used by Gemma 3."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    if name.startswith("vision_tower.vision_model.head."):
        return None
    return name if name.startswith(("vision_tower.vision_model.", "multi_modal_projector.")) else None


def _load(param: nn.Parameter, src: TensorSource, shard_id: Any = None) -> None:
    copy_into(param.data, src.read().to(param.dtype), src.name)


def _params(dtype: torch.dtype, device: torch.device, **shapes: tuple[int, ...]) -> nn.Module:
    """A module holding replicated parameters of these names and shapes."""
    m = nn.Module()
    for name, shape in shapes.items():
        setattr(m, name, make_param(shape, dtype, device, _load, {None}))
    return m


def _linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.weight, m.bias)


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.eps, self.heads = cfg.layer_norm_eps, cfg.num_heads
        self.layer_norm1 = _params(dtype, device, weight=(h,), bias=(h,))
        self.layer_norm2 = _params(dtype, device, weight=(h,), bias=(h,))
        self.self_attn = nn.Module()
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, proj, _params(dtype, device, weight=(h, h), bias=(h,)))
        self.mlp = nn.Module()
        self.mlp.fc1 = _params(dtype, device, weight=(i, h), bias=(i,))
        self.mlp.fc2 = _params(dtype, device, weight=(h, i), bias=(h,))

    def _norm(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, m.weight.shape, m.weight, m.bias, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, patches, hidden]."""
        a, (b, n, h) = self.self_attn, x.shape
        y = self._norm(self.layer_norm1, x)
        q, k, v = (_linear(p, y).view(b, n, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=q.shape[-1] ** -0.5)
        x = x + _linear(a.out_proj, o.transpose(1, 2).reshape(b, n, h))
        y = F.gelu(_linear(self.mlp.fc1, self._norm(self.layer_norm2, x)), approximate="tanh")
        return x + _linear(self.mlp.fc2, y)


class Gemma3VisionEncoder(nn.Module):
    """uint8 RGB images [N, image_size, image_size, 3] -> [N, mm_tokens_per_image, text_hidden_size].
    It reads only VisionConfig's fields and `tokens_per_side`, so arch_config.VisionConfig serves too."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        h, p = cfg.hidden_size, cfg.patch_size
        model = nn.Module()
        model.embeddings = nn.Module()
        model.embeddings.patch_embedding = _params(dtype, device, weight=(h, cfg.num_channels, p, p), bias=(h,))
        model.embeddings.position_embedding = _params(dtype, device, weight=((cfg.image_size // p) ** 2, h))
        model.encoder = nn.Module()
        model.encoder.layers = nn.ModuleList(_EncoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        model.post_layernorm = _params(dtype, device, weight=(h,), bias=(h,))
        self.vision_tower = nn.Module()
        self.vision_tower.vision_model = model
        self.multi_modal_projector = _params(dtype, device, mm_input_projection_weight=(h, cfg.text_hidden_size))
        self.multi_modal_projector.mm_soft_emb_norm = _params(dtype, device, weight=(h,))
        for name, value in (("mean", cfg.image_mean), ("std", cfg.image_std)):  # per channel, float32
            self.register_buffer(name, torch.tensor(value, dtype=torch.float32, device=device).view(1, -1, 1, 1),
                                 persistent=False)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, C] -> float32 [N, C, H, W], as transformers' image processor computes it
        (rescaled in float64, then normalized in float32)."""
        x = (pixels.permute(0, 3, 1, 2).double() * (1 / 255)).float()
        return (x - self.mean) / self.std

    def _tower(self, x: torch.Tensor) -> torch.Tensor:
        m, p = self.vision_tower.vision_model, self.cfg.patch_size
        emb = m.embeddings
        x = F.conv2d(x.to(self.dtype), emb.patch_embedding.weight, emb.patch_embedding.bias, stride=p)
        x = x.flatten(2).transpose(1, 2) + emb.position_embedding.weight
        for layer in m.encoder.layers:
            x = layer(x)
        post = m.post_layernorm
        return F.layer_norm(x, post.weight.shape, post.weight, post.bias, self.cfg.layer_norm_eps)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' Gemma3MultiModalProjector: average-pool the patch grid, RMS-normalize in
        float32 times (1 + w), back to the dtype, then multiply by the projection."""
        b, _, h = x.shape
        side, proj = self.cfg.image_size // self.cfg.patch_size, self.multi_modal_projector
        kernel = side // self.cfg.tokens_per_side
        x = F.avg_pool2d(x.transpose(1, 2).reshape(b, h, side, side).contiguous(), kernel, kernel)
        x = x.flatten(2).transpose(1, 2)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.cfg.layer_norm_eps)
        y = (y * (1.0 + proj.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return torch.matmul(y, proj.mm_input_projection_weight).to(x.dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Each image is encoded alone, so its rows do not depend on the others in the call."""
        size, c = self.cfg.image_size, self.cfg.num_channels
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (size, size, c):
            raise ValueError(f"images must be [N, {size}, {size}, {c}], got {list(pixels.shape)}")
        if pixels.shape[0] == 0:
            return torch.empty(0, self.cfg.mm_tokens_per_image, self.cfg.text_hidden_size, dtype=self.dtype,
                               device=self.mean.device)
        x = self.normalize(pixels.to(self.mean.device))
        return torch.cat([self._project(self._tower(x[i : i + 1])) for i in range(x.shape[0])])
