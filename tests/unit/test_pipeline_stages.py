"""What one pipeline stage holds, in one process: its layers, its KV pool, the tensors it reads."""

from __future__ import annotations

import pytest

from shardserve.cli.main import main
from shardserve.config import EngineConfig
from shardserve.distributed.layout import LayoutError
from shardserve.distributed.pipeline import Stage, split_layers
from shardserve.engine import model_runner
from shardserve.engine.model_runner import ModelRunner
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.weights import read_model_config


def test_even_split_puts_the_remainder_first():
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert split_layers(5, 5) == [(i, i + 1) for i in range(5)]
    assert split_layers(30, 3, (10, 12, 8)) == [(0, 10), (10, 22), (22, 30)]


@pytest.mark.parametrize("pp,partition,message", [
    (6, None, "--pp-size 6 exceeds the model's 5 layers"),
    (2, (2, 2), "--pp-layer-partition 2,2 must be 2 counts >= 1 .* summing to the model's 5 layers"),
    (2, (5,), "--pp-layer-partition 5 must be 2 counts"),
    (2, (0, 5), "--pp-layer-partition 0,5 must be 2 counts"),
])
def test_bad_splits_name_the_flag(pp, partition, message):
    with pytest.raises(LayoutError, match=message):
        split_layers(5, pp, partition)


def test_cli_refuses_a_malformed_partition(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--pp-size", "2", "--pp-layer-partition", "3,x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--pp-layer-partition" in err and "comma-separated integers" in err and len(err.splitlines()) == 1


REAL_SOURCES = model_runner.checkpoint_sources


def load_stage(path: str, stage: Stage, monkeypatch, **cfg) -> tuple[ModelRunner, list[str]]:
    """Build one stage's runner, recording the checkpoint tensors it read."""
    read: list[str] = []
    real = REAL_SOURCES

    def recording(ckpt, quantization="none"):
        sources, total = real(ckpt, quantization)

        def wrap(src):
            original = src.read

            def read_it(*args, **kwargs):
                read.append(src.name)
                return original(*args, **kwargs)

            src.read = read_it
            return src

        return (wrap(s) for s in sources), total

    monkeypatch.setattr(model_runner, "checkpoint_sources", recording)
    ckpt = resolve_checkpoint(path)
    return ModelRunner(EngineConfig(model=path, show_progress=False, **cfg), ckpt, read_model_config(ckpt),
                       stage=stage), read


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
def test_each_stage_reads_only_its_own_tensors(tiny_model, monkeypatch, arch):
    path, _ = tiny_model(arch, 5)
    _, first = load_stage(path, Stage(0, 3, 0, 2), monkeypatch, num_pages=8)
    _, middle = load_stage(path, Stage(1, 3, 2, 4), monkeypatch, num_pages=8)
    _, last = load_stage(path, Stage(2, 3, 4, 5), monkeypatch, num_pages=8)

    def layers(names):
        return sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})

    assert layers(first) == [0, 1] and layers(middle) == [2, 3] and layers(last) == [4]
    assert "model.embed_tokens.weight" in first
    assert not any("embed" in n or "norm.weight" == n.split("model.")[-1] for n in middle)
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    if arch == "llama_tied":  # the last stage's head is the embedding matrix, read there too
        assert "model.embed_tokens.weight" in last
    else:
        assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last


def test_a_stage_pool_covers_its_own_layers(tiny_model, monkeypatch):
    """The same KV memory holds pages for 5 layers at one stage, for 2 at a 2-layer stage."""
    path, _ = tiny_model("llama", 5)
    budget = 5 * 2 * 8 * 2 * 16 * 4 * 10  # exactly 10 pages of 5 layers (2 KV heads x 16 dims, fp32)
    whole, _ = load_stage(path, Stage(0, 1, 0, 5), monkeypatch, kv_cache_memory=budget, page_size=8)
    part, _ = load_stage(path, Stage(1, 2, 3, 5), monkeypatch, kv_cache_memory=budget, page_size=8)
    assert whole.num_pages == 10 and part.num_pages == 25
    assert part.pool.k.shape[0] == 2
    assert part.kv_views[:3] == [None] * 3 and part.kv_views[3] is not None
