"""deploy/kubernetes: every container's command parses with shardserve's own parser (with the
values Kubernetes and LeaderWorkerSet substitute), and every Secret, volume, port and address a
manifest names exists where it points."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from shardserve.cli.flags import deployment
from shardserve.cli.main import build_parser
from shardserve.cli.router_flags import router_mode_error
from shardserve.cli.serve_flags import disaggregation_config

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
RECIPES = sorted(p.name for p in ROOT.glob("*.yaml") if p.name != "models-pvc.yaml")


def documents() -> list[dict]:
    return [d for p in sorted(ROOT.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def secrets() -> dict[str, set[str]]:
    """The Secrets the secrets/ kustomization generates: name -> keys (one per file)."""
    kust = yaml.safe_load((ROOT / "secrets" / "kustomization.yaml").read_text())
    return {g["name"]: {Path(f.split("=")[0]).name for f in g["files"]} for g in kust["secretGenerator"]}


def pods(doc: dict) -> list[tuple[str, dict, dict]]:
    """(what, pod template, the environment LWS adds) of a workload."""
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [(doc["metadata"]["name"], doc["spec"]["template"], {})]
    if doc["kind"] == "LeaderWorkerSet":
        lws = doc["spec"]["leaderWorkerTemplate"]
        leader = f"{doc['metadata']['name']}-0.{doc['metadata']['name']}"
        env = {"LWS_GROUP_SIZE": str(lws["size"]), "LWS_LEADER_ADDRESS": leader}
        return [(f"{doc['metadata']['name']} leader", lws["leaderTemplate"], {**env, "LWS_WORKER_INDEX": "0"}),
                *[(f"{doc['metadata']['name']} worker {i}", lws["workerTemplate"],
                   {**env, "LWS_WORKER_INDEX": str(i)}) for i in range(1, lws["size"])]]
    return []


def argv(container: dict, env: dict) -> list[str]:
    """The container's arguments as the process sees them: $(VAR) replaced as Kubernetes does."""
    values = {**env, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    out = []
    for a in container["args"]:
        for name in re.findall(r"\$\((\w+)\)", a):
            assert name in values, f"{container['name']}: $({name}) is set by nothing"
            a = a.replace(f"$({name})", values[name])
        out.append(a)
    return out


def containers() -> list[tuple[str, dict, dict, list[str], object]]:
    """(what, pod template, container, argv, parsed args) of every container."""
    out = []
    for doc in documents():
        for what, template, env in pods(doc):
            for c in template["spec"]["containers"]:
                assert c["command"] == ["shardserve"], what
                args = argv(c, env)
                out.append((what, template, c, args, build_parser().parse_args(args)))
    return out


def test_every_recipe_has_workloads():
    kinds = {p: [d["kind"] for d in yaml.safe_load_all((ROOT / p).read_text()) if d] for p in RECIPES}
    assert kinds == {"multinode-lws.yaml": ["LeaderWorkerSet", "Service"],
                     "pd.yaml": ["StatefulSet", "Service", "StatefulSet", "Service", "Deployment", "Service"],
                     "replicas.yaml": ["StatefulSet", "Service", "Deployment", "Service"]}


@pytest.mark.parametrize("item", containers(), ids=lambda item: item[0])
def test_each_command_parses_and_its_deployment_is_consistent(item):
    what, template, c, args, parsed = item
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    env = {e["name"] for e in c.get("env", [])}
    if parsed.command == "router":
        assert router_mode_error(parsed) is None, what
        assert "SHARDSERVE_WORKER_API_KEY" in env, what  # else every replica answers it 401
    else:
        assert parsed.command == "serve", what
        dep = deployment(parsed, **disaggregation_config(parsed))  # the layout's and configs' own checks
        if parsed.nnodes > 1:
            assert "SHARDSERVE_DIST_SECRET" in env, what
            dist_port = int(parsed.dist_init_addr.rsplit(":", 1)[1])
            if parsed.node_rank == 0:  # node 0's ports the others reach (docs/multinode.md)
                assert sorted(ports.values())[-4:] == [dist_port + i for i in range(4)], what
            else:
                assert "http" not in ports and "readinessProbe" not in c, what  # node 0 serves HTTP
                return
        cfg = dep.engine
        if cfg.disaggregation_mode == "prefill":
            assert ports["bootstrap"] == cfg.disaggregation_port and "SHARDSERVE_DIST_SECRET" in env, what
        if cfg.disaggregation_mode == "decode":
            kv = sorted(v for k, v in ports.items() if k.startswith("kv-"))
            assert kv == [cfg.disaggregation_port + r for r in range(parsed.tp_size)], what
            assert "SHARDSERVE_DIST_SECRET" in env, what
    assert ports["http"] == parsed.port and parsed.host == "0.0.0.0", what
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}, what
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == parsed.port, what
    assert "SHARDSERVE_API_KEY" in env, what


def test_every_secret_volume_and_claim_exists():
    made, claims = secrets(), {d["metadata"]["name"] for d in documents() if d["kind"] == "PersistentVolumeClaim"}
    for what, template, c, _, _ in containers():
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in made.get(ref["name"], ()), f"{what}: {e['name']} reads {ref}"
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{what}: mounts {m['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, what


def selected(service: dict) -> list[dict]:
    """The containers of the pod templates a Service selects."""
    want = service["spec"]["selector"].items()
    return [c for _, t, c, _, _ in containers() if want <= t["metadata"]["labels"].items()]


def test_every_service_port_and_router_address_reaches_a_container():
    services = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "Service"}
    sets = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "StatefulSet"}
    for name, s in services.items():
        chosen = selected(s)
        assert chosen, f"Service {name} selects no pod"
        for p in s["spec"]["ports"]:
            assert all(p["targetPort"] in {q["name"] for q in c["ports"]} for c in chosen), f"{name}: {p}"
    lws = {d["metadata"]["name"] for d in documents() if d["kind"] == "LeaderWorkerSet"}
    # LWS_LEADER_ADDRESS resolves through the headless Service LWS makes under its own name,
    # which it does not make where a Service of that name exists.
    assert not lws & set(services), lws & set(services)
    ports_of = {t["metadata"]["labels"]["app"]: parsed.port for _, t, _, _, parsed in containers()}
    for what, _, _, _, parsed in containers():
        if parsed.command != "router":
            continue
        listed: dict[str, set[int]] = {}
        for url in (parsed.worker_urls or []) + (parsed.prefill or []) + (parsed.decode or []):
            host, port = urlsplit(url).hostname, urlsplit(url).port
            pod, service = host.split(".", 1)
            owner, index = pod.rsplit("-", 1)
            ss = sets[owner]
            # A pod's own name resolves only through its StatefulSet's headless Service.
            assert ss["spec"]["serviceName"] == service and int(index) < ss["spec"]["replicas"], f"{what}: {url}"
            assert services[service]["spec"].get("clusterIP") == "None", f"{what}: {url}"
            # A pod's name reaches the container itself, not a Service port: it must be its --port.
            assert port == ports_of[ss["spec"]["template"]["metadata"]["labels"]["app"]], f"{what}: {url}"
            assert int(index) not in listed.setdefault(owner, set()), f"{what} lists {pod} twice"
            listed[owner].add(int(index))
        for owner, seen in listed.items():  # every replica it fronts
            assert len(seen) == sets[owner]["spec"]["replicas"], f"{what} lists {len(seen)} of {owner}'s replicas"
