"""Two launchers on one machine acting as two nodes (--nnodes 2): TP 2 across them gives TP 1's
tokens through the server and through LLM; a mismatched node, a node started first, a node
killed mid-generation and Ctrl-C on node 0 each end as the user must see, with no process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import zmq
from test_launch import session_members

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import LongStream, free_port  # noqa: E402

pytestmark = pytest.mark.slow


STARTED: list[Node] = []


@pytest.fixture(autouse=True)
def no_node_outlives_its_test():
    """A failed assertion must not leave launchers running into the next tests."""
    yield
    while STARTED:
        node = STARTED.pop()
        for pid in [node.proc.pid, *session_members(node.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait()


class Node:
    """One launcher in its own session, so everything it started can be found afterwards."""

    def __init__(self, args: list[str], log: str, module: str = "shardserve", prefix: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", module, *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        STARTED.append(self)

    def read(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.read():
            assert self.proc.poll() is None or text in self.read(), f"exited before {text!r}:\n{self.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.read()[-3000:]}"
            time.sleep(0.1)

    def finish(self, timeout: float = 30) -> tuple[int, list[int]]:
        """Exit code, and any process of its session still alive a few seconds later."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        deadline = time.monotonic() + 5
        while session_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = session_members(self.proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self.log.close()
        return code, left


@pytest.fixture(autouse=True)
def deployment_secret(monkeypatch):
    """Every launcher of these tests (and the processes it starts) holds the same secret."""
    monkeypatch.setenv("SHARDSERVE_DIST_SECRET", "multinode-test-secret-0123456789")


def grid_flags(path: str, addr: str, rank: int, tp: int = 2, pp: int = 1) -> list[str]:
    return ["serve", "--model", path, "--tp-size", str(tp), "--pp-size", str(pp), "--nnodes", "2", "--node-rank",
            str(rank), "--dist-init-addr", addr, "--num-pages", "64", "--dist-timeout", "20"]


@pytest.fixture
def two_hosts():
    """Node 1's network namespace joined to this one by a veth pair (10.213.N.1 here, .2 there),
    as two machines are; None where the machine allows no namespaces."""
    tag = os.getpid() % 10000
    ns, here, there, net = f"ss-{tag}", f"ssa{tag}", f"ssb{tag}", f"10.213.{tag % 250}"
    setup = [["ip", "netns", "add", ns], ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
             ["ip", "link", "set", there, "netns", ns], ["ip", "addr", "add", f"{net}.1/24", "dev", here],
             ["ip", "link", "set", here, "up"], ["ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", there],
             ["ip", "-n", ns, "link", "set", there, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        yield None
        return
    yield {"addr": f"{net}.1", "here": here, "there": there, "prefix": ("ip", "netns", "exec", ns)}
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth pair with it


# Loopback addresses at TP 2, network namespaces at PP 2 (a stage per node): namespaces at TP 2
# add nothing the two do not cover, for CI time.
@pytest.mark.parametrize("hosts,tp,pp", [("loopback", 2, 1), ("namespaces", 1, 2)],
                         ids=["loopback-tp2", "namespaces-pp2"])
def test_server_across_two_nodes_matches_one_process(tiny_model, tmp_path, two_hosts, hosts, tp, pp):
    """TP 2 splits every layer across the nodes; PP 2 puts one stage on each node (the residual
    stream and the sampled tokens cross between them: the results inbox is node 0's PORT + 3)."""
    path, _ = tiny_model("llama")
    host, prefix, env0, env1 = "127.0.0.1", (), {}, {}
    if hosts == "namespaces":
        if two_hosts is None:
            pytest.skip("this machine allows no network namespaces; the loopback case covers the rest")
        host, prefix = two_hosts["addr"], two_hosts["prefix"]
        env0, env1 = {"GLOO_SOCKET_IFNAME": two_hosts["here"]}, {"GLOO_SOCKET_IFNAME": two_hosts["there"]}
    addr, port = f"{host}:{free_port()}", free_port()
    # Node 1 first: it waits, bounded, saying for what.
    node1 = Node(grid_flags(path, addr, 1, tp, pp), str(tmp_path / "node1.log"), prefix=prefix, env=env1)
    node1.wait_for(f"node 1: waiting for node 0 at tcp://{host}:{int(addr.rsplit(':')[1]) + 1}")
    node0 = Node([*grid_flags(path, addr, 0, tp, pp), "--port", str(port)], str(tmp_path / "node0.log"), env=env0)
    node0.wait_for(f"serving {os.path.basename(path)} on http://127.0.0.1:{port}")
    assert "node 1 joined (2 of 2 nodes)" in node0.read()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    got = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=12, temperature=0).choices[0].text
    assert "on http://" not in node1.read() and "Uvicorn" not in node1.read()  # node 1 serves no HTTP
    if hosts == "loopback":
        # Forged messages from a process without the deployment secret: a node failure on the node
        # channel, a listener on the plan feed. Neither gets through; the server serves on.
        assert forge(host, int(addr.rsplit(":")[1])) == []
        again = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=12, temperature=0)
        assert again.choices[0].text == got and "forged" not in node0.read()
        assert "refused a peer on the node channel" in node0.read()  # logged, once
    node0.proc.send_signal(signal.SIGINT)  # Ctrl-C on node 0 stops node 1 too
    assert node0.finish() == (0, [])
    assert node1.finish() == (0, [])
    assert "node 1: node 0 stopped; stopping this node's ranks" in node1.read()

    from shardserve import LLM, SamplingParams

    with LLM(path, num_pages=64, show_progress=False) as one:
        want = one.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].text
    assert got == want


def forge(host: str, port: int) -> list[bytes]:
    """Send node 0's channel (PORT + 1) a NodeFailed and listen on its plan feed (PORT + 2), as a
    process without the secret; what the listener heard. Shown by events, not by listening a
    while: each socket's own monitor reports its handshake failed (a socket sends and receives
    nothing before its handshake succeeds), and none ever succeeds."""
    from zmq.utils.monitor import recv_monitor_message

    from shardserve.ipc.messages import encode
    from shardserve.ipc.messages.nodes import NodeFailed

    failed = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    ctx = zmq.Context()
    dealer, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
    monitors = [s.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_SUCCEEDED) for s in (dealer, sub)]
    for sock in (dealer, sub):
        sock.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{host}:{port + 1}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{host}:{port + 2}")
    dealer.send(encode(NodeFailed(reason="forged")), zmq.NOBLOCK)  # queued until a handshake succeeds
    events: list[list[int]] = [[], []]
    deadline = time.monotonic() + 30
    while not all(any(e & failed for e in ev) for ev in events):
        assert time.monotonic() < deadline, f"the forgers' handshakes neither failed nor succeeded: {events}"
        for ev, mon in zip(events, monitors):
            if mon.poll(50):
                ev.append(recv_monitor_message(mon)["event"])
    assert not any(zmq.EVENT_HANDSHAKE_SUCCEEDED in ev for ev in events), events
    heard = []
    while sub.poll(0):
        heard.append(sub.recv())
    for sock in (*monitors, dealer, sub):
        sock.close(0)
    ctx.term()
    return heard


LLM_SCRIPT = """
import sys
import time
from shardserve import LLM, SamplingParams
llm = LLM({path!r}, tp_size=2, nnodes=2, node_rank=int(sys.argv[1]), dist_init_addr={addr!r}, num_pages=64,
          show_progress=False)
if llm.node.node_rank == 0:
    time.sleep(7)  # longer than the heartbeat timeout: node 1 must still be there
    print("TOKENS", llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].token_ids)
    llm.shutdown()
else:
    print("NODE1 EXIT", llm.exit_code)
"""


def test_llm_across_two_nodes(tiny_model, tmp_path):
    path, model = tiny_model("llama")
    script = tmp_path / "two_nodes.py"
    script.write_text(LLM_SCRIPT.format(path=path, addr=f"127.0.0.1:{free_port()}"))
    nodes = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for r in (0, 1)]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    import torch

    with torch.no_grad():
        ref = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert f"TOKENS {ref[0, 3:].tolist()}" in outs[0][0]
    assert "NODE1 EXIT 0" in outs[1][0]
    assert session_members(nodes[0].pid) == [] and session_members(nodes[1].pid) == []


@pytest.mark.parametrize("other", ["world", "model"])
def test_node_with_other_flags_is_refused_on_both(tiny_model, tmp_path, other):
    path, _ = tiny_model("llama")
    path1 = tiny_model("qwen3")[0] if other == "model" else path
    addr = f"127.0.0.1:{free_port()}"
    node0 = Node([*grid_flags(path, addr, 0), "--port", str(free_port())], str(tmp_path / "node0.log"))
    node1 = Node(grid_flags(path1, addr, 1, tp=4 if other == "world" else 2), str(tmp_path / "node1.log"))
    (code0, left0), (code1, left1) = node0.finish(60), node1.finish(60)
    why = {"world": "node 1 was started with world size 4 but node 0 runs 2",
           "model": f"node 1 was started with model {os.path.basename(path1)} but node 0 runs "
                    f"{os.path.basename(path)}"}[other]
    assert code0 != 0 and code1 != 0 and left0 == [] and left1 == []
    assert why in node0.read() and f"node 0 refused node 1: {why}" in node1.read()
    assert "Traceback" not in node0.read() + node1.read()


def test_killed_node_fails_node0_naming_it(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    addr, port = f"127.0.0.1:{free_port()}", free_port()
    node1 = Node(grid_flags(path, addr, 1), str(tmp_path / "node1.log"))
    node0 = Node([*grid_flags(path, addr, 0), "--port", str(port)], str(tmp_path / "node0.log"))
    node0.wait_for("serving")

    stream = LongStream(f"http://127.0.0.1:{port}", max_tokens=500)
    stream.wait_running()
    start = time.monotonic()
    os.kill(node1.proc.pid, signal.SIGKILL)  # the launcher; its ranks follow it (PR_SET_PDEATHSIG)
    saw_503 = False
    while node0.proc.poll() is None and time.monotonic() - start < 30:
        try:
            saw_503 |= httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    stream.assert_failed(30)
    code0, left0 = node0.finish()
    _, left1 = node1.finish()
    assert code0 != 0 and left0 == [] and left1 == []
    assert saw_503
    assert "lost node 1 (rank 1)" in node0.read(), node0.read()[-3000:]
