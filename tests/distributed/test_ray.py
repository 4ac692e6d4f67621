"""Ray as the executor (--distributed-executor-backend ray) on a Ray cluster of two nodes on this
machine (ray.cluster_utils: two raylets, two node ids, one IP), as an operator's cluster is
reached. Through LLM: TP 2 with one rank per node, PP 2 with one stage per node, and DP attention
with EP 2 (a replica per node) give transformers' tokens and logprobs. Through the server and the
openai client: DP 2 with a replica per node gives transformers' tokens and logprobs; an actor
killed mid-stream fails that stream naming its replica, a killed rank and a lost node are named,
and the replica serves again each time; the deployment secret is in no process's argv or
environment and in no log line. Placements the cluster cannot hold are refused in bounded time;
when the server or LLM stops, or is killed, no rank, actor or placement group is left."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time

import openai
import pytest
import torch
from test_pipeline import GREEDY, assert_logprobs_close, hf_reference, prompts

from shardserve import LLM, SamplingParams
from shardserve.launch import LaunchError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import LongStream, Server, alive  # noqa: E402

ray = pytest.importorskip("ray")  # in the test extra: CI runs these
pytestmark = pytest.mark.slow
RAY = dict(distributed_executor_backend="ray")
PAGES = dict(num_pages=64, page_size=8)


def ray_processes() -> set[int]:
    """Pids of Ray's own daemons on this machine (raylet, GCS)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0]
        except OSError:
            continue
        if cmd.endswith((b"/raylet", b"/gcs_server")):
            out.add(int(pid))
    return out


def assert_gone(pids: list[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if alive(p)]
        time.sleep(0.1)


def test_without_an_address_a_cluster_is_started_here_and_stopped(tiny_model, monkeypatch):
    """No --ray-address and no RAY_ADDRESS: Ray starts on this machine for the command's life (the
    first test, before the module's cluster exists)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path, _ = tiny_model("llama")
    before = ray_processes()
    prompt = [[5, 6, 7, 8]]
    with LLM(path, **PAGES) as one:
        want = one.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].token_ids
    with LLM(path, tp_size=2, threads=1, **PAGES, **RAY) as llm:
        started = ray_processes() - before
        got = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].token_ids
    assert got == want
    assert started  # Ray's daemons ran here ...
    assert_gone(list(started), timeout=30)  # ... and stopped with the LLM


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of 2 CPUs each: a --tp-size 2 replica of 1 thread a rank fits on one."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def assert_all_free(cluster, timeout: float = 30) -> None:
    """Every CPU of the cluster free again: no placement group or actor of ours holds one."""
    ray.init(address=cluster.address, configure_logging=False)
    try:
        deadline = time.monotonic() + timeout
        while (free := ray.available_resources().get("CPU", 0)) != 4:
            assert time.monotonic() < deadline, f"{free} of 4 CPUs free"
            time.sleep(0.2)
    finally:
        ray.shutdown()


# (arch, sizes): 2 threads a rank, so each node holds one rank.
LAYOUTS = [("llama", dict(tp_size=2)), ("llama", dict(pp_size=2)),
           ("qwen3_moe", dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2))]


@pytest.mark.parametrize("arch,sizes", LAYOUTS, ids=["tp2", "pp2", "dp2-attention-ep2"])
def test_layouts_with_a_rank_per_node_match_transformers(cluster, tiny_model, caplog, arch, sizes):
    path, model = tiny_model(arch, 5)
    batch = prompts(model.config.vocab_size)
    hf = [hf_reference(model, p) for p in batch]
    with caplog.at_level(logging.WARNING, "shardserve.launch"):
        llm = LLM(path, threads=2, ray_address=cluster.address, show_progress=False, **PAGES, **sizes, **RAY)
    try:
        where = llm._backend.grid.placement.where
        ranks = [p.pid for p in llm._backend.grid.tree.procs.values()]
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert where[0]["node_id"] != where[1]["node_id"]  # one rank per node
    for out, (tokens, lps) in zip(outs, hf, strict=True):
        assert out.token_ids == tokens
        assert_logprobs_close(out.logprobs, lps)
    across = "Ray placed the tensor group of ranks 0-1 on nodes" in caplog.text
    assert across == ("tp_size" in sizes and "dp_size" not in sizes)  # said where TP crosses nodes, only there
    assert_gone(ranks + [w["pid"] for w in where.values()])
    assert_all_free(cluster)


def test_placements_the_cluster_cannot_hold_are_refused_in_bounded_time(cluster, tiny_model):
    """Too big for the cluster: refused before waiting. Big enough but busy (a script that is a
    Ray driver already holds 3 of the 4 CPUs): LLM(...) in it uses its connection, waits
    --startup-timeout for its bundles, says what is free, and leaves the script's Ray as it was."""
    from ray.util.placement_group import placement_group, remove_placement_group

    path, _ = tiny_model("llama")
    start = time.monotonic()
    with pytest.raises(LaunchError, match=re.escape('2 ranks need 2 bundles of {"CPU": 3} ({"CPU": 6}) but the Ray '
                                                    'cluster has {"CPU": 4} on 2 node(s)')):
        LLM(path, tp_size=2, threads=3, ray_address=cluster.address, num_pages=16, **RAY)
    assert time.monotonic() - start < 30
    ray.init(address=cluster.address, configure_logging=False)
    try:
        busy = placement_group([{"CPU": 2}, {"CPU": 1}], strategy="SPREAD")
        ray.get(busy.ready(), timeout=30)
        with pytest.raises(LaunchError, match=re.escape(
                "replica 0's 2 bundles of {\"CPU\": 1} were not placed within 3 s; the cluster has {\"CPU\": 1} free "
                "of {\"CPU\": 4}")):
            LLM(path, tp_size=2, threads=1, num_pages=16, startup_timeout=3, **RAY)
        assert ray.is_initialized()  # the script's own connection, untouched
        remove_placement_group(busy)
    finally:
        ray.shutdown()
    assert_all_free(cluster)


def rank_nodes(log: str) -> dict[int, tuple[str, int]]:
    """rank -> (Ray node id, actor pid), from the server's placement lines (the latest of each)."""
    return {int(r): (n, int(p)) for r, n, p in re.findall(r"rank (\d+) on Ray node (\w+) \([^,]+, actor pid (\d+)\)",
                                                             log)}


def proc_text(pid: int) -> bytes:
    """A process's argv and environment, as anyone on its machine may read them."""
    out = b""
    for part in ("cmdline", "environ"):
        with open(f"/proc/{pid}/{part}", "rb") as f:
            out += f.read()
    return out


def test_server_replicas_one_per_node_survive_dead_actors_ranks_and_nodes(cluster, tiny_model, tmp_path, monkeypatch):
    secret = "a-deployment-secret-0123456789abcdef"
    monkeypatch.setenv("SHARDSERVE_DIST_SECRET", secret)
    path, model = tiny_model("llama")
    g = torch.Generator().manual_seed(7)
    batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    hf = [hf_reference(model, p) for p in batch]
    server = Server("--model", path, "--dp-size", "2", "--tp-size", "2", "--threads", "1", "--num-pages", "64",
                    "--page-size", "8", "--load-balance-method", "round_robin", "--replica-restart-limit", "5",
                    "--distributed-executor-backend", "ray", "--ray-address", cluster.address,
                    log_path=str(tmp_path / "log"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def answers() -> list[tuple[list[int], list[float]]]:
        """Each prompt twice (round robin: once on each replica): its token ids and logprobs."""
        out = []
        for p in batch * 2:
            lp = client.completions.create(model=None, prompt=p, max_tokens=12, temperature=0, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True,
                                                       "min_tokens": 12}).choices[0].logprobs
            out.append(([int(t.removeprefix("token_id:")) for t in lp.tokens], lp.token_logprobs))
        return out

    def assert_transformers(got) -> None:
        for (tokens, lps), (want, ref) in zip(got, hf * 2, strict=True):
            assert tokens == want
            assert all(abs(lp - float(ref[i, t])) < 1e-4 for i, (t, lp) in enumerate(zip(tokens, lps, strict=True)))

    try:
        nodes = rank_nodes(server.read_log())
        secret_seen = [secret.encode() in proc_text(pid) for pid in
                       [server.last_pid(f"scheduler-{r}") for r in range(4)] + [pid for _, pid in nodes.values()]]
        assert_transformers(answers())
        # Replica 1's leader's actor killed mid-stream (round robin: one stream on each replica).
        streams = [LongStream(server.url, max_tokens=400, prompt=[50 + i, 6]) for i in range(2)]
        for s in streams:
            s.wait_running()
        os.kill(nodes[2][1], signal.SIGKILL)
        failed = [s.ended_in_error(60) for s in streams]
        server.wait_replica(1, "serving", restarts=1)
        assert_transformers(answers())
        os.kill(server.last_pid("scheduler-3"), signal.SIGKILL)  # a tensor peer of replica 1
        server.wait_replica(1, "serving", restarts=2)
        assert_transformers(answers())
        # The node holding the replica that is not on the head node is lost; a new node joins and
        # Ray places that replica's bundles there.
        worker = next(iter(cluster.worker_nodes))
        lost = 0 if nodes[0][0] == worker.node_id[:12] else 1
        restarts = server.wait_replica(lost, "serving")["replicas"][lost]["restarts"]
        cluster.remove_node(worker)
        cluster.add_node(num_cpus=2)
        server.wait_replica(lost, "serving", restarts=restarts + 1, timeout=180)
        assert_transformers(answers())
        moved = rank_nodes(server.read_log())
        ranks = [server.last_pid(f"scheduler-{r}") for r in range(4)]
    finally:
        code, left = server.stop()
    log = server.read_log()
    assert code == 0 and left == [], log[-3000:]
    # Each replica's tensor group on one node, the two replicas on two nodes.
    assert nodes[0][0] == nodes[1][0] != nodes[2][0] == nodes[3][0], nodes
    # The stream on replica 1 ended in an error naming it; the other finished.
    assert failed.count(True) == 1, failed
    bad = next(s for s, f in zip(streams, failed, strict=True) if f)
    assert any("replica 1 stopped while this request was running" in e for e in bad.events), bad.events[-3:]
    assert re.search(rf"replica 1: rank 2 on node {nodes[2][0]} \(dp 1, tp 0\) died: The actor is dead because its "
                     rf"worker process has died.*; starting it again", log), log[-3000:]
    assert "rank 2's Ray actor is gone" in log  # started again in its bundle
    assert "replica 1: scheduler-3 (dp 1, tp 1) was killed by signal 9; starting it again" in log
    leader = 2 * lost
    assert moved[leader][0] not in (nodes[0][0], nodes[2][0]), (nodes, moved)  # on the new node
    died = rf"replica {lost}: rank {leader} on node {nodes[leader][0]} \(dp {lost}, tp 0\) died: its Ray node is gone"
    assert re.search(died, log), log[-3000:]
    assert secret_seen == [False] * 8 and secret not in log
    assert_gone(ranks + [pid for _, pid in moved.values()])
    assert_all_free(cluster)


def test_a_killed_server_leaves_nothing_on_the_cluster(cluster, tiny_model, tmp_path):
    """SIGKILL on the API process: Ray ends its actors (and with them the ranks) and its
    placement groups, as it ends any dead driver's."""
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--pp-size", "2", "--threads", "2", "--num-pages", "64", "--page-size", "8",
                    "--distributed-executor-backend", "ray", "--ray-address", cluster.address,
                    log_path=str(tmp_path / "log"))
    ranks = [server.last_pid(f"scheduler-{r}") for r in range(2)]
    actors = [pid for _, pid in rank_nodes(server.read_log()).values()]
    assert len(actors) == 2 and all(alive(p) for p in ranks + actors)
    _, left = server.stop(signal.SIGKILL)
    assert left == []  # the tokenizers and detokenizer, its own children
    assert_gone(ranks + actors, timeout=60)
    assert_all_free(cluster, timeout=60)
