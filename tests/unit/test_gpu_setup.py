"""What a GPU user's start-up decides before any weight loads, with the device facts injected (the
CPU machines that run CI have no GPU): layouts the GPUs cannot hold refused in one line naming
the flag, dtype `auto`, and each rank bound to its own GPU with NCCL's communicators made eagerly."""

from __future__ import annotations

import pytest
import torch

from shardserve.distributed import groups
from shardserve.distributed.layout import Layout
from shardserve.launch.checks import check_device
from shardserve.platform import pick_dtype


def test_two_ranks_on_one_gpu_are_refused():
    with pytest.raises(ValueError, match=r"--device cuda:0 puts all 2 ranks of this machine on one GPU, which NCCL "
                                         r"cannot join; use --device cuda \(rank i on cuda:i\)"):
        check_device("cuda:0", Layout.from_sizes(tp=2), cuda_devices=8)


def test_more_ranks_than_gpus_are_refused():
    with pytest.raises(ValueError, match=r"the default device \(cuda: 2 visible\): 4 CUDA devices needed \(4 ranks "
                                         r"on this machine\), 2 visible"):
        check_device(None, Layout.from_sizes(tp=2, pp=2), cuda_devices=2)
    with pytest.raises(ValueError, match=r"--device cuda:3: 4 CUDA devices needed \(1 rank on this machine\), 2"):
        check_device("cuda:3", Layout.from_sizes(), cuda_devices=2)
    check_device("cuda", Layout.from_sizes(tp=2), cuda_devices=2)  # one GPU a rank: fine
    check_device("cuda:1", Layout.from_sizes(), cuda_devices=2)


@pytest.fixture
def gpu(monkeypatch):
    """A pretend GPU: whether it has bfloat16 is the test's to say."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")

    def has_bf16(flag: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: flag)

    return has_bf16


def test_dtype_auto(gpu):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    gpu(True)
    assert pick_dtype("auto", "bfloat16", cuda, gguf=False) == ("bfloat16", "auto: the checkpoint's own")
    assert pick_dtype("auto", "float32", cuda, gguf=False)[0] == "float32"  # stays float32 unless asked
    assert pick_dtype("auto", "float16", cuda, gguf=False)[0] == "float16"
    assert pick_dtype("auto", "float32", cuda, gguf=True)[0] == "bfloat16"
    assert pick_dtype("auto", "bfloat16", cpu, gguf=False) == ("float32", "auto: the CPU kernels run in float32")
    assert pick_dtype("bfloat16", "float32", cpu, gguf=False) == ("bfloat16", "asked")
    gpu(False)
    assert pick_dtype("auto", "bfloat16", cuda, gguf=False) == (
        "float16", "auto: the checkpoint's bfloat16, which Tesla T4 lacks")
    with pytest.raises(ValueError, match="--dtype bfloat16: Tesla T4 has no bfloat16; use float16"):
        pick_dtype("bfloat16", "bfloat16", cuda, gguf=False)


def test_a_bfloat16_checkpoint_runs_in_float32_on_the_cpu(tiny_model, tmp_path, caplog):
    import copy

    from shardserve.config import EngineConfig
    from shardserve.scheduler.engine_core import EngineCore

    _, model = tiny_model("llama")
    path = str(tmp_path / "bf16")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
    assert '"bfloat16"' in open(f"{path}/config.json").read()
    with caplog.at_level("INFO", logger="shardserve.loader.weights"):
        core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=16))
    assert core.cfg.dtype == "float32" and core.runner.dtype == torch.float32
    assert "dtype float32 (auto: the CPU kernels run in float32)" in caplog.text


def test_each_rank_binds_its_gpu_and_makes_nccl_communicators_eagerly(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kw):
        seen.update(kw, backend=backend)
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("bound", d))
    monkeypatch.setattr(groups.dist, "init_process_group", init_process_group)
    with pytest.raises(Stop):
        groups.init_distributed(Layout.from_sizes(tp=2), 1, "127.0.0.1:1", torch.device("cuda", 1), 5.0)
    assert seen["bound"] == torch.device("cuda", 1) and seen["device_id"] == torch.device("cuda", 1)
    assert seen["backend"] == "cpu:gloo,cuda:nccl"


def test_a_gpu_driver_this_torch_cannot_use_leaves_the_cpu(monkeypatch):
    """No --device, a GPU in the driver's list, but a CPU-only torch: the ranks run on the CPU,
    as pick_device decides, rather than being refused."""
    from shardserve.launch import checks

    monkeypatch.setattr(checks, "visible_gpus", lambda: 1)
    assert torch.version.cuda is None
    check_device(None, Layout.from_sizes(tp=2))


def test_cuda_visible_devices_stops_at_an_invalid_entry(monkeypatch):
    from shardserve.launch import devices

    monkeypatch.setattr(devices.os, "listdir", lambda path: ["0000:01:00.0", "0000:02:00.0"])
    for value, count in (("-1", 0), ("0,-1,1", 1), ("1", 1), ("0,1", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert devices.visible_gpus() == count


def test_kv_value_bytes_where_the_ranks_compute(monkeypatch):
    """The API process sizes KV pages without torch: bfloat16 on the CPU keeps a float32 cache."""
    from shardserve.config import EngineConfig
    from shardserve.launch import devices

    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)
    assert devices.kv_value_bytes(EngineConfig(model="m", dtype="bfloat16")) == 4
    assert devices.kv_value_bytes(EngineConfig(model="m", dtype="bfloat16", device="cuda:0")) == 2
    assert devices.kv_value_bytes(EngineConfig(model="m", dtype="float16")) == 2
    monkeypatch.setattr(devices, "visible_gpus", lambda: 1)  # the default device is then CUDA
    assert devices.kv_value_bytes(EngineConfig(model="m", dtype="bfloat16")) == 2
    assert devices.kv_value_bytes(EngineConfig(model="m", dtype="bfloat16", device="cpu")) == 4
