"""Flags checked against the model and this machine before any worker starts.

Each of these would otherwise fail (or be silently changed) on every rank after seconds of
imports and weight loading, and reach the user as a worker's traceback. Here it is one line
naming the flag. torch is imported only for a --device other than the CPU: the API process
never needs it otherwise.
"""

from __future__ import annotations

import math
import os
import socket

from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.expert_placement import PlacementPlan, load_counts
from shardserve.distributed.layout import Layout, LayoutError
from shardserve.ipc.sockets import listen_socket
from shardserve.kvcache.budget import kv_budget_message
from shardserve.launch import LaunchError
from shardserve.launch.deployment import Deployment
from shardserve.launch.devices import kv_value_bytes, visible_gpus
from shardserve.launch.nodes import NodeSpec
from shardserve.launch.spec_checks import check_speculative
from shardserve.layers.sharding import head_shard  # plain Python
from shardserve.loader.model_path import Checkpoint, resolve_checkpoint
from shardserve.loader.weights import read_model_config


def check_deployment(plan: Deployment, ckpt: Checkpoint, torchrun: bool = False) -> None:
    """Every check of a deployment, in one pass before any process starts (the server's and the
    offline API's alike): what the flags, this machine or the model cannot take, one line each."""
    cfg, layout, node = plan.engine, plan.layout, plan.node
    check_disaggregation(cfg, layout, node, torchrun)
    if layout.ep > 1 and layout.dp > 1 and not layout.dp_attention:
        raise LayoutError(f"--ep-size {layout.ep} with --dp-size {layout.dp} needs --enable-dp-attention (independent "
                          f"replicas cannot share an expert all-to-all)")
    if layout.ep > 1 and layout.ep != layout.moe_span:
        raise LayoutError(f"--ep-size {layout.ep} must equal --tp-size ({layout.moe_span}) for now (experts split "
                          f"whole over every rank of the MoE layers; experts also split within a rank group are "
                          f"not built yet)")
    if layout.dp > 1 and layout.nnodes > 1:
        raise LayoutError(f"--dp-size {layout.dp} with --nnodes {layout.nnodes} is not supported yet: run one "
                          f"multi-node server per replica and put `shardserve router` in front")
    node.check(layout)
    if node.executor == "ray":
        check_ray(cfg, node, torchrun)
    else:
        check_device(cfg.device, layout)
    check_quantization(cfg, ckpt)
    mc = read_model_config(ckpt)
    layout.check_model(mc.num_layers, mc.num_heads, mc.num_experts)
    check_context(cfg, mc, layout.cp)
    check_kv_budget(cfg, layout, mc)
    if cfg.ep_num_redundant_experts or cfg.ep_expert_placement:
        check_placement(cfg, layout, mc)
    if cfg.pp_layer_partition is not None or layout.pp > 1:
        from shardserve.distributed.pipeline import split_layers  # torch: imported only when checked

        split_layers(mc.num_layers, layout.pp, cfg.pp_layer_partition)
    check_speculative(cfg, layout, ckpt)
    check_async_scheduling(cfg, layout)
    if cfg.enable_lora:
        check_lora(cfg, layout, mc)
    if (cfg.pp_micro_batches or 1) > 1 and layout.pp == 1:
        raise LayoutError(f"--pp-micro-batches {cfg.pp_micro_batches} needs --pp-size > 1 (one stage runs one "
                          f"micro-batch at a time)")


def check_async_scheduling(cfg: EngineConfig, layout: Layout) -> None:
    """--async-scheduling where its placeholders can be filled: the first stage's tensor rank 0
    samples, and sends the tokens to its tensor peers (a pipeline's last stage would have to send
    them back to the first, and context ranks split the inputs otherwise: not built)."""
    if not cfg.async_scheduling:
        return
    refusals = ((layout.pp > 1 or layout.cp > 1,
                 f"needs --pp-size 1 and --cp-size 1 for now (got {layout.pp} and {layout.cp})"),
                (layout.dp_attention,
                 "is not supported with --enable-dp-attention yet (its replicas step in lockstep)"),
                (cfg.speculative_config is not None,
                 "cannot run with --speculative-method: a step's proposals follow from the step before's tokens"),
                (cfg.disaggregation_mode != "null", "is not supported with --disaggregation-mode yet"))
    for refused, why in refusals:
        if refused:
            raise LayoutError(f"--async-scheduling {why}")


def check_lora(cfg: EngineConfig, layout: Layout, mc: ModelConfig) -> None:
    """--enable-lora where adapters run as PEFT defines them; elsewhere one line saying what not."""
    why = None
    if mc.mla is not None:
        why = "on latent attention (DeepSeek MLA) models"
    elif cfg.disaggregation_mode != "null":
        why = "with --disaggregation-mode"
    if why is not None:
        raise LayoutError(f"--enable-lora is not supported {why} yet")


def check_quantization(cfg: EngineConfig, ckpt: Checkpoint) -> None:
    """--quantization int8 where it cannot run (each rank would fail the same way after start)."""
    if cfg.quantization != "int8":
        return
    if ckpt.is_gguf:
        raise LayoutError("--quantization int8 quantizes a safetensors checkpoint at load; a GGUF keeps its own "
                          "formats (--quantization auto) or is expanded (none)")
    if cfg.dtype not in ("float32", "auto") or (cfg.device or "cpu").startswith("cuda"):
        raise LayoutError(f"--quantization int8 runs on the CPU in float32, not --dtype {cfg.dtype} on "
                          f"{cfg.device or 'the default device'}")


def check_placement(cfg: EngineConfig, layout: Layout, mc) -> None:
    """Hot-expert replicas: refuse what would fail on every rank after model load."""
    if layout.ep == 1:
        raise LayoutError("--ep-num-redundant-experts and --ep-expert-placement need --ep-size > 1 (or "
                          "--enable-dp-attention)")
    if not cfg.ep_num_redundant_experts:
        raise LayoutError("--ep-expert-placement needs --ep-num-redundant-experts > 0 (without extra slots the "
                          "placement is the contiguous split and the file would go unused)")
    counts = load_counts(cfg.ep_expert_placement, mc.num_experts).layers if cfg.ep_expert_placement else None
    plan = PlacementPlan(layout.ep, cfg.ep_num_redundant_experts, counts)
    for layer in range(mc.num_layers):
        if mc.is_moe_layer(layer):
            plan.for_layer(layer, mc.num_experts)


def check_ray(cfg: EngineConfig, node: NodeSpec, torchrun: bool) -> None:
    """What --distributed-executor-backend ray does not run (yet), one line each; the cluster's
    own resources are checked when the ranks are placed (launch/ray_cluster.py)."""
    from shardserve.launch.ray_connect import import_ray  # Ray is an optional extra

    flag = "--distributed-executor-backend ray"
    import_ray()  # not installed: says how to install it
    if torchrun:
        raise ValueError(f"{flag} places the ranks itself: run it as a plain command, not under torchrun")
    address = node.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address.startswith("ray://"):
        raise ValueError(f"--ray-address {address}: Ray Client addresses are not supported (the ranks' channels "
                         f"need this process on a node of the cluster): run the command on a node, with the "
                         f"cluster's GCS address (HOST:6379)")
    if cfg.disaggregation_mode != "null":
        raise ValueError(f"--disaggregation-mode {cfg.disaggregation_mode} does not run with {flag} yet: start "
                         f"the prefill and decode instances with the local executor")
    if cfg.device and ":" in cfg.device:
        raise ValueError(f"--device {cfg.device} with {flag}: Ray gives each rank its own GPU; use --device cuda")


def check_disaggregation(cfg: EngineConfig, layout: Layout, node: NodeSpec, torchrun: bool) -> None:
    """What disaggregated prefill/decode runs on today, refused up front with the flag to change."""
    if cfg.disaggregation_mode == "null":
        return
    flag = f"--disaggregation-mode {cfg.disaggregation_mode}"
    for size, name in ((layout.pp, "--pp-size"), (layout.cp, "--cp-size"), (layout.dp, "--dp-size"),
                       (layout.nnodes, "--nnodes")):
        if size > 1:
            raise ValueError(f"{flag} runs with {name} 1 for now (got {size}): start one instance per replica "
                             f"behind the router")
    if torchrun:
        raise ValueError(f"{flag} does not run under torchrun yet")
    if not node.secret:
        raise ValueError(f"{flag} needs the deployment secret that keys the KV channels between the instances: "
                         f"set SHARDSERVE_DIST_SECRET (the same on both), or --dist-secret-file PATH")
    # The KV channels' ports (a prefill leader's one; a decode rank's port + tensor rank), tried now:
    # a busy one fails in a second with its flag named, not after model load in a scheduler.
    ports = range(cfg.disaggregation_port, cfg.disaggregation_port + (layout.tp if cfg.disaggregation_mode == "decode"
                                                                      else 1))
    for port in ports:
        try:
            bind_socket(cfg.disaggregation_host, port).close()
        except LaunchError as e:
            raise ValueError(f"--disaggregation-bootstrap-port: {e}") from None


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before starting workers, so a busy port fails in a second, not after model load."""
    try:
        return listen_socket(host, port)
    except OSError as e:
        raise LaunchError(str(e)) from None


def check_dense(model: str | None, ep: int) -> None:
    """--ep-size on a dense model, refused before the layout's rank arithmetic (which would speak
    of "the 1 ranks the MoE layers span")."""
    if ep == 1:
        return
    ckpt = resolve_checkpoint(model)
    if not read_model_config(ckpt).num_experts:
        raise LayoutError(f"--ep-size {ep} needs a mixture-of-experts model; {ckpt.name} has no experts "
                          f"(it is dense: leave --ep-size out)")


def check_context(cfg: EngineConfig, model_cfg: ModelConfig, cp: int = 1) -> None:
    """A --max-model-len beyond the model's positions is refused, not clamped in silence; so is
    context parallelism over a sliding window or a softcap (the ring attends to whole contexts, uncapped)."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise LayoutError(f"--max-model-len {cfg.max_model_len} exceeds the model's context limit of {limit} tokens "
                          f"(max_position_embeddings): give at most {limit}, or leave it out")
    if cp > 1 and model_cfg.attn_logit_softcap:
        raise LayoutError(f"--cp-size {cp}: context parallelism has no attention logit softcapping (the model caps "
                          f"its scores at {model_cfg.attn_logit_softcap}, as Gemma 2 does): leave --cp-size out")
    window = model_cfg.attention_window
    if cp > 1 and window is not None and model_cfg.served_length(cfg.max_model_len) > window:
        raise LayoutError(f"--cp-size {cp}: context parallelism has no sliding-window attention (the model's window "
                          f"is {window} tokens): give --max-model-len {window} or less")


def kv_page_bytes(cfg: EngineConfig, layout: Layout, model_cfg: ModelConfig) -> int:
    """Bytes of the largest KV page any rank holds (K and V, all its layers): the rank with the
    most layers and KV heads needs the most per page, and every rank keeps as many pages as it."""
    if cfg.pp_layer_partition:
        layers = max(cfg.pp_layer_partition)
    else:
        layers = math.ceil(model_cfg.num_layers / layout.pp)  # the even split puts the remainder first
    heads = max(head_shard(model_cfg.num_heads, model_cfg.num_kv_heads, layout.tp, r).num_kv
                for r in range(layout.tp))
    return cfg.page_size * model_cfg.kv_values_per_token(heads, layers) * kv_value_bytes(cfg)


def check_kv_budget(cfg: EngineConfig, layout: Layout, model_cfg: ModelConfig) -> None:
    """--kv-cache-memory in bytes must hold one page (a fraction of free memory is sized on the
    rank, where the free memory is known)."""
    if cfg.num_pages is not None or cfg.kv_cache_memory <= 1:
        return
    per_page = kv_page_bytes(cfg, layout, model_cfg)
    if cfg.kv_cache_memory < per_page:
        raise LayoutError(kv_budget_message(cfg.kv_cache_memory, cfg.kv_cache_memory, per_page, cfg.page_size))


def check_device(device: str | None, layout: Layout, cuda_devices: int | None = None) -> None:
    """--device naming something this torch or machine lacks (a CUDA device on a CPU-only build),
    or a layout the GPUs cannot hold: two ranks on one GPU (NCCL cannot join them), more ranks
    than GPUs. `cuda_devices` stands in for torch's count (tests)."""
    if device == "cpu" or (device is None and (cuda_devices if cuda_devices is not None else visible_gpus()) == 0):
        return  # the CPU (and the API process need not load torch to know it)
    import torch

    if device is None and cuda_devices is None and (torch.version.cuda is None or torch.cuda.device_count() == 0):
        return  # a driver this torch cannot use: the ranks run on the CPU, as pick_device decides
    try:
        dev = torch.device(device or "cuda")
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type != "cuda":
        return
    if cuda_devices is None and torch.version.cuda is None:
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) is a CPU-only build; use --device "
                         f"cpu, or install a CUDA build of torch")
    found = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    ranks = layout.ranks_per_node
    flag = f"--device {device}" if device else f"the default device (cuda: {found} visible)"
    if dev.index is not None and ranks > 1:
        raise ValueError(f"--device {device} puts all {ranks} ranks of this machine on one GPU, which NCCL cannot "
                         f"join; use --device cuda (rank i on cuda:i)")
    needed = dev.index + 1 if dev.index is not None else ranks
    if found < needed:
        raise ValueError(f"{flag}: {needed} CUDA device{'s' if needed > 1 else ''} needed "
                         f"({ranks} rank{'s' if ranks > 1 else ''} on this machine), {found} visible")
