"""`--distributed-executor-backend ray`: the rank grid's processes placed on a Ray cluster.

The API process (HTTP, tokenizers, detokenizer, router) stays where the command runs; every
scheduler rank runs on the node Ray gives it, started by a `RankHost` actor (launch/ray_host.py).
Each replica is one placement group with a bundle per rank ({"CPU": threads}, or {"GPU": 1,
"CPU": 1}), PACKed, so replicas spread over nodes as they fill. Within a replica the bundles are
ordered by Ray node id, the API process's node first, and ranks taken tensor-fastest in that
order: a tensor group lies on one node wherever Ray packed it onto one (a warning says where it
did not).

Every channel a rank uses is TCP and CURVE-keyed by the deployment secret (drawn now when none
is set): the launcher's ready channel, the API inbox and the detokenizer on this machine, and
each replica's inbox, plan feed, results inbox and cache events on its leader's node
(`ipc.sockets.TcpHosts`). The secret reaches the ranks inside their pickled arguments (a Ray
object), never in argv, environment or logs.
"""

from __future__ import annotations

import logging
import time
import uuid

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout
from shardserve.ipc.secure import new_secret
from shardserve.ipc.sockets import Endpoints, TcpHosts
from shardserve.launch import LaunchError
from shardserve.launch.nodes import NodeSpec
from shardserve.launch.ray_connect import connect, import_ray, passed_env
from shardserve.launch.ray_host import RankHost, RemoteProc, actor_died, free_base

log = logging.getLogger("shardserve.launch")
ACTOR_WAIT = 60.0  # seconds for an actor to answer, or to start again in its bundle


def order_bundles(bundle_nodes: list[str], first: str) -> list[int]:
    """Bundle indexes in the order ranks take them: `first` (the API process's node) first, then
    the nodes holding more of them, then by node id, so each node's bundles are contiguous and
    the big blocks (whole tensor groups, where they fit) come early."""
    count = {n: bundle_nodes.count(n) for n in bundle_nodes}
    return sorted(range(len(bundle_nodes)),
                  key=lambda b: (bundle_nodes[b] != first, -count[bundle_nodes[b]], bundle_nodes[b], b))


def split_tensor_group(layout: Layout, node_of: dict[int, str]) -> str | None:
    """The first tensor group whose ranks fell on more than one node, said in a line; else None."""
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(node_of):
        c = layout.coords(rank)
        groups.setdefault((c.dp, c.pp, c.cp), []).append(rank)
    for ranks in groups.values():
        nodes = sorted({node_of[r] for r in ranks})
        if len(nodes) > 1:
            names = ", ".join(n[:12] for n in nodes)
            return f"Ray placed the tensor group of ranks {ranks[0]}-{ranks[-1]} on nodes {names}"
    return None


class RayPlacement:
    """The grid's ranks on a Ray cluster: placement groups, one `RankHost` actor per rank, the
    channels' addresses. `release` removes all of it (and a cluster this process started)."""

    def __init__(self, cfg: EngineConfig, layout: Layout, node: NodeSpec, timeout: float):
        self.ray = ray = import_ray()
        self.layout, self.secret = layout, node.secret or new_secret()
        self.groups, self.actors = [], {}
        self.closed = False
        # A script that is a Ray driver already (ray.init before LLM(...)) keeps its connection.
        self.connected_here = not ray.is_initialized()
        if self.connected_here:
            connect(ray, node.ray_address)
        try:
            self._place(cfg, timeout)
        except OSError as e:  # an actor that did not answer or start: said as a launch failure
            self.release()
            raise LaunchError(f"--distributed-executor-backend ray: {e}") from None
        except BaseException:
            self.release()
            raise

    def _get(self, ref, what: str):
        """ray.get with a bound; OSError naming `what` if the actor is gone or silent (the
        supervisor's restart treats that as a failed start), or once the placement is released."""
        ray = self.ray
        if self.closed:
            raise OSError(f"{what}: the Ray placement was released (the server is stopping)")
        try:
            return ray.get(ref, timeout=ACTOR_WAIT)
        except ray.exceptions.GetTimeoutError:
            raise OSError(f"{what}: no answer within {ACTOR_WAIT:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise OSError(f"{what}: {actor_died(e)}") from None

    def _place(self, cfg: EngineConfig, timeout: float) -> None:
        ray, layout = self.ray, self.layout
        total = ray.cluster_resources()
        gpu = (cfg.device or "").startswith("cuda") or (cfg.device is None and total.get("GPU", 0) > 0)
        # Each rank's threads are its bundle's CPUs: --threads, else one beside a GPU, else the
        # cluster's CPUs shared out over the ranks.
        self.threads = cfg.threads or (1 if gpu else max(1, int(total.get("CPU", 1)) // layout.world))
        bundle = {"GPU": 1.0, "CPU": float(self.threads)} if gpu else {"CPU": float(self.threads)}
        need = {k: v * layout.world for k, v in bundle.items()}
        if any(total.get(k, 0) < v for k, v in need.items()):
            raise LaunchError(f"--distributed-executor-backend ray: {layout.world} ranks need {layout.world} bundles "
                              f"of {_res(bundle)} ({_res(need)}) but the Ray cluster has {_res(total)} on "
                              f"{len(ray.nodes())} node(s)", exit_code=2)
        from ray.util.placement_group import placement_group

        self.first = ray.get_runtime_context().get_node_id()
        run = uuid.uuid4().hex[:12]  # names unique in the namespace, whoever else places there
        for d in range(layout.dp):
            pg = placement_group([dict(bundle)] * len(layout.replica_ranks(d)), strategy="PACK",
                                 name=f"shardserve-{run}-replica-{d}")
            self.groups.append(pg)
        self._wait_ready(bundle, timeout)
        self._start_actors(bundle)
        self._addresses()

    def _wait_ready(self, bundle: dict, timeout: float) -> None:
        ray, start = self.ray, time.monotonic()
        for d, pg in enumerate(self.groups):
            while True:
                try:
                    ray.get(pg.ready(), timeout=min(10.0, max(0.1, start + timeout - time.monotonic())))
                    break
                except ray.exceptions.GetTimeoutError:
                    waited = time.monotonic() - start
                    if waited >= timeout:
                        raise LaunchError(
                            f"--distributed-executor-backend ray: replica {d}'s {len(self.layout.replica_ranks(d))} "
                            f"bundles of {_res(bundle)} were not placed within {timeout:.0f} s; the cluster has "
                            f"{_res(ray.available_resources())} free of {_res(ray.cluster_resources())}") from None
                    log.info("waiting for Ray to place replica %d (%.0f s so far) ...", d, waited)

    def _start_actors(self, bundle: dict) -> None:
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self.ray.remote(RankHost)
        node_of: dict[int, str] = {}
        self.new_actor = {}  # rank -> a call that starts its actor in its bundle (again, after a loss)
        for d, pg in enumerate(self.groups):
            nodes = placement_group_table(pg)["bundles_to_node_id"]
            nodes = [nodes[b] for b in range(len(nodes))]
            for rank, b in zip(self.layout.replica_ranks(d), order_bundles(nodes, self.first), strict=True):
                node_of[rank] = nodes[b]
                in_bundle = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
                options = actor.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                        scheduling_strategy=in_bundle)
                self.new_actor[rank] = options.remote
                self.actors[rank] = options.remote()
        split = split_tensor_group(self.layout, node_of)
        if split:  # it runs, as TP over --nnodes does, but every layer's all-reduce crosses machines
            log.warning("%s: its all-reduces cross between nodes every layer (a node with room for --tp-size %d "
                        "ranks keeps them inside one)", split, self.layout.tp)
        self.where = {rank: self._get(a.where.remote(), f"rank {rank}'s Ray actor") for rank, a in self.actors.items()}
        for rank in sorted(self.where):
            self._say_where(rank)

    def _say_where(self, rank: int, what: str = "") -> None:
        w = self.where[rank]
        log.info("rank %d on Ray node %s (%s, actor pid %d)%s%s", rank, w["node_id"][:12], w["ip"], w["pid"],
                 f", GPU {','.join(w['gpus'])}" if w["gpus"] else "", f": {what}" if what else "")

    def _addresses(self) -> None:
        ip = self.ray.util.get_node_ip_address()
        head = free_base(ip, 3)  # the API inbox, the detokenizer, the ready channel
        leaders = []
        self.leaders = [self.layout.replica_ranks(d)[0] for d in range(self.layout.dp)]
        for leader in self.leaders:  # each leader's inbox, plan feed, results inbox, cache events
            port = self._get(self.actors[leader].free_port.remote(4), f"rank {leader}'s Ray actor")
            leaders.append(f"{self.where[leader]['ip']}:{port}")
        self.hosts = TcpHosts(head=f"{ip}:{head}", leaders=tuple(leaders))
        names = sorted(passed_env())
        log.info("Ray placed %d ranks on %d node(s); passing %s to them", self.layout.world,
                 len({w["node_id"] for w in self.where.values()}), ", ".join(names) or "no environment variables")

    def endpoints(self, num_tokenizers: int) -> Endpoints:
        return Endpoints.create(num_tokenizers, dp=self.layout.dp, secret=self.secret, hosts=self.hosts)

    def prepare(self, ranks: range) -> dict[int, str]:
        """Before `ranks` start (again): every one's actor live (started again in its bundle if
        lost, so its node, GPUs and environment are known), and fresh rendezvous addresses
        (host:port on each world's first rank's node): one per replica, or one for all under
        data-parallel attention (one world). OSError when an actor cannot be had."""
        for rank in ranks:
            self.live_actor(rank)
        out: dict[int, str] = {}
        by_world: dict[int, str] = {}
        for rank in ranks:
            key = self.layout.coords(rank).dp if self.layout.independent_replicas else 0
            if key not in by_world:
                first = self.layout.replica_ranks(key)[0]
                port = self._get(self.live_actor(first).free_port.remote(1), f"rank {first}'s Ray actor")
                by_world[key] = f"{self.where[first]['ip']}:{port}"
            out[rank] = by_world[key]
        return out

    def device_index(self, rank: int) -> int | None:
        """The GPU's index among CUDA_VISIBLE_DEVICES (`env`): every GPU our ranks hold on the node."""
        w = self.where[rank]
        return self._node_gpus(w["node_id"]).index(w["gpus"][0]) if w["gpus"] else None

    def _node_gpus(self, node_id: str) -> list[str]:
        return sorted({g for w in self.where.values() if w["node_id"] == node_id for g in w["gpus"]}, key=_gpu_key)

    def env(self, rank: int) -> dict[str, str]:
        """What rank `rank`'s process gets on its node: the passed variables, its threads, its GPUs."""
        env = {**passed_env(), "OMP_NUM_THREADS": str(self.threads)}
        if self.where[rank]["gpus"]:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._node_gpus(self.where[rank]["node_id"]))
        return env

    def live_actor(self, rank: int):
        """Rank `rank`'s actor, started again in its bundle if it is gone (its process killed, or
        its node lost and the bundle placed anew by Ray). OSError when that cannot be had: the
        bundle not placed within ACTOR_WAIT s, or a replica leader's node changed (its channels'
        addresses are fixed for the server's life)."""
        ray = self.ray
        if self.closed:
            raise OSError(f"rank {rank}: the Ray placement was released (the server is stopping)")
        try:
            ray.get(self.actors[rank].ping.remote(), timeout=ACTOR_WAIT)
            return self.actors[rank]
        except getattr(ray.exceptions, "ActorUnavailableError", TimeoutError):
            raise OSError(f"rank {rank}'s Ray actor is unreachable for now") from None
        except ray.exceptions.RayActorError as e:
            log.warning("rank %d's Ray actor is gone (%s); starting another in its bundle", rank, actor_died(e))
        except ray.exceptions.GetTimeoutError:
            raise OSError(f"rank {rank}'s Ray actor did not answer within {ACTOR_WAIT:.0f} s") from None
        fresh = self.new_actor[rank]()
        try:
            where = ray.get(fresh.where.remote(), timeout=ACTOR_WAIT)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            ray.kill(fresh)
            raise OSError(f"rank {rank}'s Ray bundle could not be placed again within {ACTOR_WAIT:.0f} s "
                          f"({type(e).__name__}); the cluster has {_res(ray.available_resources())} free") from None
        old = self.where[rank]
        if rank in self.leaders and where["ip"] != old["ip"]:
            ray.kill(fresh)
            raise OSError(f"rank {rank} leads its replica and its bundle moved from {old['ip']} to {where['ip']}: "
                          f"its channels' addresses cannot follow")
        self.actors[rank], self.where[rank] = fresh, where
        self._say_where(rank, "started again")
        return fresh

    def spawner(self, rank: int, role: str):
        """How the process tree starts rank `rank`: on its actor (started again if it is gone), a
        `RemoteProc` back."""

        def spawn(name: str, payload: bytes, env: dict[str, str]) -> RemoteProc:
            actor = self.live_actor(rank)
            who = f"rank {rank} on node {self.where[rank]['node_id'][:12]}" + (f" ({role})" if role else "")
            pid = self._get(actor.spawn.remote(name, payload, env), f"{who}: its process could not be started")
            return RemoteProc(actor, pid, who, self.where[rank]["node_id"])

        return spawn

    def release(self) -> None:
        """Kill the actors (their ranks die with them), remove the placement groups, disconnect."""
        from ray.util.placement_group import remove_placement_group

        self.closed = True  # first: a replica being started again stops asking for actors
        for a in self.actors.values():
            try:
                self.ray.kill(a)
            except Exception:  # already gone with its node
                pass
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.actors or self.groups:
            log.info("Ray: stopped %d rank actor%s and removed %d placement group%s", len(self.actors),
                     "" if len(self.actors) == 1 else "s", len(self.groups), "" if len(self.groups) == 1 else "s")
        if self.connected_here:
            self.ray.shutdown()


def _gpu_key(g: str):
    return (0, int(g)) if g.isdigit() else (1, g)


def _res(res: dict) -> str:
    shown = {k: v for k, v in res.items() if k in ("CPU", "GPU")}
    return "{" + ", ".join(f'"{k}": {v:g}' for k, v in sorted(shown.items())) + "}"
