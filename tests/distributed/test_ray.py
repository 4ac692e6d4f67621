"""Ray as the executor (--distributed-executor-backend ray) on a Ray cluster of two nodes on this
machine (ray.cluster_utils: two raylets, two node ids, one IP), as an operator's cluster is
reached: pipeline stages on two nodes give transformers' tokens and logprobs; data-parallel
replicas land one per node behind one server, a dead rank and a dead actor are named and their
replica serves again; placements the cluster cannot hold are refused in one line; and when the
server or LLM stops, no rank, actor or placement group is left on any node."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import openai
import pytest
from test_pipeline import ENGINE, GREEDY, LAYERS, assert_logprobs_close, hf_reference, prompts

from shardserve import LLM, SamplingParams
from shardserve.launch import LaunchError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import Server, alive  # noqa: E402

ray = pytest.importorskip("ray")  # in the test extra: CI runs these
pytestmark = pytest.mark.slow
RAY = dict(distributed_executor_backend="ray")


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


def test_without_an_address_a_cluster_is_started_here_and_stopped(tiny_model, monkeypatch):
    """No --ray-address and no RAY_ADDRESS: Ray starts on this machine for the command's life (the
    first test, before the module's cluster exists)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path, _ = tiny_model("llama")
    before = ray_processes()
    prompt = [[5, 6, 7, 8]]
    with LLM(path, num_pages=64, page_size=8) as one:
        want = one.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].token_ids
    with LLM(path, tp_size=2, threads=1, num_pages=64, page_size=8, **RAY) as llm:
        started = ray_processes() - before
        got = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].token_ids
    assert got == want
    assert started  # Ray's daemons ran here ...
    assert_gone(list(started), timeout=30)  # ... and stopped with the LLM


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of 2 CPUs each: a --tp-size 2 replica fits on one, a third rank does not."""
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


def assert_gone(pids: list[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if alive(p)]
        time.sleep(0.1)


def test_pipeline_stages_on_two_ray_nodes_match_transformers(cluster, tiny_model):
    path, model = tiny_model("llama", LAYERS)
    batch = prompts(model.config.vocab_size)
    hf = [hf_reference(model, p) for p in batch]
    llm = LLM(path, pp_size=2, threads=2, ray_address=cluster.address, **RAY, **ENGINE)
    try:
        where = llm._backend.grid.placement.where
        ranks = [p.pid for p in llm._backend.grid.tree.procs.values()]
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert where[0]["node_id"] != where[1]["node_id"]  # one stage per node
    for out, (tokens, lps) in zip(outs, hf, strict=True):
        assert out.token_ids == tokens
        assert_logprobs_close(out.logprobs, lps)
    assert_gone(ranks + [w["pid"] for w in where.values()])
    assert_all_free(cluster)


def test_placements_the_cluster_cannot_hold_are_refused_in_one_line(cluster, tiny_model):
    path, _ = tiny_model("llama")
    start = time.monotonic()
    with pytest.raises(LaunchError, match=re.escape('2 ranks need 2 bundles of {"CPU": 3} ({"CPU": 6}) but the Ray '
                                                    'cluster has {"CPU": 4} on 2 node(s)')):
        LLM(path, tp_size=2, threads=3, ray_address=cluster.address, num_pages=16, **RAY)
    with pytest.raises(LaunchError, match=r"tensor group of ranks 0-3 on nodes \w+, \w+; each node needs room for "
                                          r"--tp-size 4 ranks"):
        LLM(path, tp_size=4, threads=1, ray_address=cluster.address, num_pages=16, **RAY)
    assert time.monotonic() - start < 60  # refused at placement, not after a start-up timeout
    assert_all_free(cluster)


def test_bundles_that_never_come_free_are_refused_within_the_startup_timeout(cluster, tiny_model):
    """The cluster is big enough but busy: a script that is a Ray driver already holds 3 of its 4
    CPUs in a placement group of its own. LLM(...) in it uses its connection, waits
    --startup-timeout for its bundles, says what is free, and leaves the script's Ray as it was."""
    from ray.util.placement_group import placement_group, remove_placement_group

    path, _ = tiny_model("llama")
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


def test_server_replicas_one_per_node_survive_a_dead_rank_and_a_dead_actor(cluster, tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    prompts_ = [[5 + i, 6, 7] for i in range(4)]
    with LLM(path, num_pages=64, page_size=8) as one:
        want = [o.text for o in one.generate(prompts_, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)]
    server = Server("--model", path, "--dp-size", "2", "--tp-size", "2", "--threads", "1", "--num-pages", "64",
                    "--page-size", "8", "--load-balance-method", "round_robin", "--replica-restart-limit", "5",
                    "--distributed-executor-backend", "ray", "--ray-address", cluster.address,
                    log_path=str(tmp_path / "log"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def answers() -> list[str]:
        return [client.completions.create(model=None, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in prompts_ * 2]  # round robin: each prompt on each replica

    try:
        nodes = rank_nodes(server.read_log())
        first = answers()
        os.kill(server.last_pid("scheduler-3"), signal.SIGKILL)  # a tensor peer of replica 1
        server.wait_replica(1, "serving", restarts=1)
        second = answers()
        os.kill(nodes[2][1], signal.SIGKILL)  # replica 1's leader's actor: Ray reports it dead
        server.wait_replica(1, "serving", restarts=2)
        third = answers()
        # The node holding the replica that is not on the head node is lost; a new node joins and
        # Ray places that replica's bundles there.
        worker = next(n for n in cluster.worker_nodes)
        lost = 0 if nodes[0][0] == worker.node_id[:12] else 1
        restarts = server.wait_replica(lost, "serving")["replicas"][lost]["restarts"]
        cluster.remove_node(worker)
        cluster.add_node(num_cpus=2)
        server.wait_replica(lost, "serving", restarts=restarts + 1, timeout=180)
        fourth = answers()
        moved = rank_nodes(server.read_log())
        ranks = [server.last_pid(f"scheduler-{r}") for r in range(4)]
        actors = [pid for _, pid in moved.values()]
    finally:
        code, left = server.stop()
    log = server.read_log()
    assert code == 0 and left == [], log[-3000:]
    # Each replica's tensor group on one node, the two replicas on two nodes.
    assert nodes[0][0] == nodes[1][0] != nodes[2][0] == nodes[3][0], nodes
    assert first == second == third == fourth == want * 2
    leader = 2 * lost
    assert moved[leader][0] not in (nodes[0][0], nodes[2][0]), (nodes, moved)  # on the new node
    died = rf"replica {lost}: rank {leader} on node {nodes[leader][0]} \(dp {lost}, tp 0\) died: its Ray node is gone"
    assert re.search(died, log), log[-3000:]
    assert "replica 1: scheduler-3 (dp 1, tp 1) was killed by signal 9; starting it again" in log
    assert re.search(rf"replica 1: rank 2 on node {nodes[2][0]} \(dp 1, tp 0\) died: .+; starting it again", log), \
        log[-3000:]
    assert "rank 2's Ray actor is gone" in log  # started again in its bundle
    assert_gone(ranks + actors)
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
