"""--distributed-executor-backend ray without a cluster: the rank order over Ray's bundles (the
API process's node first, each node's ranks contiguous), a tensor group across nodes named, every
channel's TCP address, Ray's reason for a dead actor in one line, and the settings
refused before anything starts (each one line naming the flag)."""

from __future__ import annotations

import sys

import pytest
from test_cli import _refused

from shardserve.distributed.layout import Layout, LayoutError
from shardserve.ipc.sockets import Endpoints, TcpHosts
from shardserve.launch import LaunchError
from shardserve.launch.nodes import NodeSpec
from shardserve.launch.ray_cluster import order_bundles, split_tensor_group
from shardserve.launch.ray_connect import import_ray, passed_env
from shardserve.launch.ray_host import actor_died


def test_bundles_are_ordered_api_node_first_then_by_node():
    nodes = ["b", "a", "api", "b", "api", "a"]
    assert order_bundles(nodes, "api") == [2, 4, 1, 5, 0, 3]
    assert order_bundles(["x", "y"], "elsewhere") == [0, 1]


def test_a_tensor_group_across_nodes_is_named():
    layout = Layout.from_sizes(tp=2, pp=2)
    assert split_tensor_group(layout, {0: "n1", 1: "n1", 2: "n2", 3: "n2"}) is None  # a stage per node: fine
    assert split_tensor_group(layout, {0: "n1", 1: "n1", 2: "n1", 3: "n2"}) == (
        "Ray placed the tensor group of ranks 2-3 on nodes n1, n2")
    dp = Layout.from_sizes(tp=2, dp=2)
    assert "ranks 0-1" in split_tensor_group(dp, {0: "n1", 1: "n2", 2: "n3", 3: "n3"})


def test_every_channel_a_placed_rank_uses_is_tcp():
    ep = Endpoints.create(2, dp=2, secret=b"s" * 32, hosts=TcpHosts(head="10.0.0.1:4000",
                                                                     leaders=("10.0.0.2:5000", "10.0.0.3:6000")))
    assert (ep.api, ep.detokenizer, ep.ready) == ("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002")
    assert [ep.leader(1), ep.fanout(1), ep.results(1), ep.events(1)] == [
        "tcp://10.0.0.3:6000", "tcp://10.0.0.3:6001", "tcp://10.0.0.3:6002", "tcp://10.0.0.3:6003"]
    assert ep.leader(0) == "tcp://10.0.0.2:5000"
    # The router and the tokenizers share this machine with the API process: ipc paths.
    assert ep.scheduler.startswith("ipc://") and ep.tokenizer(1).startswith("ipc://")
    one = Endpoints.create(1, secret=b"s" * 32, hosts=TcpHosts(head="10.0.0.1:4000", leaders=("10.0.0.2:5000",)))
    assert one.scheduler == one.leader(0) == "tcp://10.0.0.2:5000"  # one replica: the tokenizers send to its leader
    plain = Endpoints.create(1, dp=2)
    assert all(a.startswith("ipc://") for a in (plain.api, plain.ready, plain.leader(1), plain.events(0)))


def test_rays_reason_is_one_line_without_its_advice():
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RankHost\n\tpid: 7\n"
            "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
            "detail: Worker unexpectedly exits. Some common causes include: (1) the OOM killer")
    assert actor_died(RuntimeError(text)) == ("The actor is dead because its worker process has died. Worker exit "
                                              "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits.")
    assert actor_died(RuntimeError("The actor died unexpectedly.\n\tpid: 3")) == "The actor died unexpectedly."


def test_passed_environment_never_carries_the_secret(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("SHARDSERVE_DIST_SECRET", "x" * 32)
    monkeypatch.setenv("UNRELATED", "1")
    env = passed_env()
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "SHARDSERVE_DIST_SECRET" not in env and "UNRELATED" not in env


def test_without_ray_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(LaunchError, match=r"needs Ray: pip install 'shardserve\[ray\]'") as e:
        import_ray()
    assert e.value.exit_code == 2


def test_ray_with_nnodes_or_an_unknown_executor_is_refused():
    with pytest.raises(LayoutError, match="places the ranks on the Ray cluster's nodes itself: leave out --nnodes"):
        NodeSpec(0, "10.0.0.1:29500", b"s" * 32, executor="ray").check(Layout.from_sizes(tp=2, nnodes=2))
    with pytest.raises(LayoutError, match="--distributed-executor-backend must be one of local, ray, got 'slurm'"):
        NodeSpec(executor="slurm").check(Layout())


@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda:1"], "--device cuda:1 with --distributed-executor-backend ray: Ray gives each rank its own "
                             "GPU; use --device cuda"),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode prefill does not run with "
                                           "--distributed-executor-backend ray yet"),
    (["--ray-address", "ray://10.0.0.1:10001"], "--ray-address ray://10.0.0.1:10001: Ray Client addresses are "
                                                "not supported"),
    (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:29500"],
     "leave out --nnodes/--node-rank/--dist-init-addr"),
])
def test_what_ray_does_not_run_is_refused_before_anything_starts(capsys, tiny_model, monkeypatch, flags, message):
    monkeypatch.setenv("SHARDSERVE_DIST_SECRET", "s" * 32)
    path, _ = tiny_model("llama")
    assert message in _refused(capsys, ["--model", path, "--distributed-executor-backend", "ray", *flags])


def test_without_ray_the_server_says_so_in_one_line(capsys, tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    path, _ = tiny_model("llama")
    assert _refused(capsys, ["--model", path, "--distributed-executor-backend", "ray"]) == (
        "shardserve: error: --distributed-executor-backend ray needs Ray: pip install 'shardserve[ray]'")


def test_an_address_where_no_cluster_answers_is_said_at_once(monkeypatch):
    """Ray retries an address that does not answer for ever; the refusal is one line at once."""
    ray = pytest.importorskip("ray")
    from shardserve.launch.ray_connect import connect, local_cluster

    with pytest.raises(LaunchError, match=r"^--ray-address 127.0.0.1:1: no Ray cluster answers there \(.*refused"):
        connect(ray, "127.0.0.1:1")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(LaunchError, match=r"^RAY_ADDRESS 127.0.0.1:1: no Ray cluster answers there"):
        connect(ray, "")
    assert not ray.is_initialized()
    # No address, and the last cluster started on this machine is gone: start one, not wait on it.
    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda *a: "127.0.0.1:1")
    assert local_cluster(ray) == "local"
