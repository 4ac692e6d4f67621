"""Real third-party clients against a live server on the tiny Llama, so a client that vLLM users run
and shardserve breaks fails here: guidellm 0.8.1 (load testing, streaming chat and text
completions) and lm-evaluation-harness 0.4.13 (`local-completions`: loglikelihood through
echo + logprobs, and generate_until).

The clients live in their own virtual environment (.ci/clients.sh; they pin their own
transformers, datasets and numpy), found at $SHARDSERVE_CLIENTS_VENV. Without it the tests fail
under CI and skip elsewhere. They never touch a hub: the tokenizer is the served model's directory,
lm-eval's tasks are local JSONL files, and HF_HUB_OFFLINE=1.

A recording proxy sits between client and server, so a refused request fails the test with the
server's error body and the request that drew it."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import httpx
import pytest
import torch
from recording_proxy import RecordingProxy
from transformers import AutoTokenizer

VENV = os.environ.get("SHARDSERVE_CLIENTS_VENV", "/tmp/shardserve-clients/venv")
GUIDELLM_REQUESTS = 30
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 8
GEN_TOKENS = 8
CLIENT_TIMEOUT = 300


pytestmark = pytest.mark.slow  # ~50 s: each client starts its own Python with torch and transformers


def client_bin(name: str) -> str:
    """The client's executable; missing, the test fails under CI and skips elsewhere."""
    path = os.path.join(VENV, "bin", name)
    if not os.access(path, os.X_OK):
        msg = f"{path} missing: install the real clients with `bash .ci/clients.sh` (or set SHARDSERVE_CLIENTS_VENV)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="module", autouse=True)
def clients_venv() -> None:
    """Checked before the server starts, so a missing install costs nothing."""
    client_bin("python")


def client_env(tmp_path) -> dict[str, str]:
    """The client's own environment: offline, its caches in the test's directory, and none of the
    server's Python path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                  "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1",
                  "PATH": os.path.join(VENV, "bin") + os.pathsep + env.get("PATH", "")}


def run_client(cmd: list[str], tmp_path, proxy: RecordingProxy, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=tmp_path, env=client_env(tmp_path) | env, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT)
    assert proc.returncode == 0, (f"{cmd[0]} exited {proc.returncode}\n{proxy.report()}\n"
                                  f"{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def proxy(tiny_server):
    p = RecordingProxy(tiny_server.url)
    yield p
    p.close()


@pytest.fixture(scope="module")
def model_id(tiny_server) -> str:
    return httpx.get(tiny_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tok(tiny_server):
    return AutoTokenizer.from_pretrained(tiny_server.model_path)


# Chat only (lm-eval above drives /v1/completions; CI time).
@pytest.mark.parametrize("request_format", ["/v1/chat/completions"])
def test_guidellm(request_format, tiny_server, proxy, model_id, tmp_path):
    """guidellm's synthetic load (streamed, ignore_eos, exact output length): every request
    succeeds and its usage counts are the ones asked for."""
    guidellm = client_bin("guidellm")
    proxy.clear()
    report = tmp_path / "guidellm.json"
    cmd = [guidellm, "run",
           "--backend", f"kind=openai_http,target={proxy.url},model={model_id},request_format={request_format}",
           "--profile", "kind=constant,rate=10",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_server.model_path}",
           "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
           "--constraint", "kind=max_duration,seconds=120",
           "--output", f"kind=json,path={report}",
           "--disable-console"]
    # One worker process: guidellm spawns up to 10 by default, each importing torch (slow on few cores).
    run_client(cmd, tmp_path, proxy, GUIDELLM__MAX_WORKER_PROCESSES="1")
    assert proxy.refused() == [], proxy.report()
    bench = json.loads(report.read_text())["benchmarks"]
    assert len(bench) == 1
    totals = bench[0]["metrics"]["request_totals"]
    assert totals == {"successful": GUIDELLM_REQUESTS, "errored": 0, "incomplete": 0,
                      "total": GUIDELLM_REQUESTS}, [r["info"]["error"] for r in bench[0]["requests"]["errored"]]
    done = bench[0]["requests"]["successful"]
    assert len(done) == GUIDELLM_REQUESTS
    for r in done:
        assert r["output_tokens"] == OUTPUT_TOKENS, r
        # The text prompts are exactly PROMPT_TOKENS of this tokenizer; chat adds its template.
        if request_format == "/v1/completions":
            assert r["prompt_tokens"] == PROMPT_TOKENS, r
        else:
            assert r["prompt_tokens"] > PROMPT_TOKENS, r
    posts = [e for e in proxy.exchanges if e.method == "POST"]
    assert len(posts) == GUIDELLM_REQUESTS and {e.path for e in posts} == {request_format}
    assert all(e.body["stream"] and e.body["ignore_eos"] for e in posts)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def greedy_choice(model, tok, contexts: list[str]) -> tuple[str, str]:
    """A (context, continuation) whose continuation is the model's 2 greedy tokens and survives
    decode + re-encode (lm-eval sends text, the server tokenizes it again)."""
    for ctx in contexts:
        ids = tok.encode(ctx)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
        cont = tok.decode(out[0, len(ids):])
        if tok.encode(ctx + cont) == out[0].tolist():
            return ctx, cont
    raise AssertionError("no context with a greedy continuation that round-trips")


def write_tasks(root, mc_docs: list[dict], gen_docs: list[dict]) -> None:
    """Two lm-eval tasks on local JSONL files (the `json` dataset builder: no hub)."""
    for name, docs in (("mc", mc_docs), ("gen", gen_docs)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)

    def common(name: str) -> str:
        return (f"task: shardserve_tiny_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {root / name}.jsonl\ntest_split: test\n" + 'doc_to_text: "{{question}}"\n')

    (root / "mc.yaml").write_text(common("mc") + (
        'output_type: multiple_choice\ntarget_delimiter: ""\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'))
    (root / "gen.yaml").write_text(common("gen") + (
        'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n'
        f"  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"))


def read_samples(out_dir, task: str) -> list[dict]:
    (path,) = glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    with open(path) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def test_lm_eval_local_completions(tiny_server, proxy, model_id, tok, tmp_path):
    """lm-eval's local-completions model on a local multiple-choice task (loglikelihood: echo,
    logprobs=1, max_tokens=1) and a generate_until task: every document gets a result, and the
    scores and texts are transformers' own."""
    lm_eval = client_bin("lm_eval")
    model = tiny_server.model
    greedy_ctx, greedy_cont = greedy_choice(model, tok, ["The capital of Italy is", "The capital of",
                                                         "What is the weather like?"])
    countries = ["France", "Italy", "Spain", "Peru", "Chile"]
    mc_docs = [{"question": f"The capital of {c} is", "choices": [" Paris", " Rome", " London"], "answer": i % 3}
               for i, c in enumerate(countries)]
    mc_docs.append({"question": greedy_ctx, "choices": [greedy_cont, " Paris"], "answer": 0})
    gen_docs = [{"question": f"Hello, how are you {w}?", "answer": " I am fine"}
                for w in ["today", "now", "there", "here", "friend"]]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks, mc_docs, gen_docs)
    out = tmp_path / "out"
    proxy.clear()
    cmd = [lm_eval, "--model", "local-completions",
           "--model_args", f"model={model_id},base_url={proxy.url}/v1/completions,"
                           f"tokenizer={tiny_server.model_path},tokenized_requests=False,num_concurrent=2,max_retries=1",
           "--tasks", "shardserve_tiny_mc,shardserve_tiny_gen", "--include_path", str(tasks),
           "--output_path", str(out), "--log_samples"]
    run_client(cmd, tmp_path, proxy)
    # lm-eval first probes for vLLM's remote tokenizer (GET /tokenizer_info); a 404 there sends it
    # to the Hugging Face tokenizer named in model_args, which is what this test means to run.
    refused = [e for e in proxy.refused() if not (e.path == "/tokenizer_info" and e.status == 404)]
    assert refused == [], proxy.report()

    (results_path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    results = json.loads(open(results_path).read())
    for task, docs in (("shardserve_tiny_mc", mc_docs), ("shardserve_tiny_gen", gen_docs)):
        assert task in results["results"], results["results"]
        assert results["n-samples"][task] == {"original": len(docs), "effective": len(docs)}

    mc = read_samples(out, "shardserve_tiny_mc")
    assert [s["doc_id"] for s in mc] == list(range(len(mc_docs)))
    greedy_seen = 0
    for s, doc in zip(mc, mc_docs):
        assert len(s["resps"]) == len(doc["choices"])
        for choice, resp in zip(doc["choices"], s["resps"]):
            ll, is_greedy = float(resp[0][0]), resp[0][1] == "True"
            ctx_len = len(tok.encode(doc["question"]))
            ids = tok.encode(doc["question"] + choice)
            lp = hf_logprobs(model, ids)
            want = sum(lp[i - 1, ids[i]].item() for i in range(ctx_len, len(ids)))
            want_greedy = all(lp[i - 1].argmax().item() == ids[i] for i in range(ctx_len, len(ids)))
            assert ll == pytest.approx(want, rel=1e-4, abs=1e-3), (doc, choice)
            assert is_greedy == want_greedy, (doc, choice)
            greedy_seen += is_greedy
    assert greedy_seen >= 1  # the greedy continuation: top_logprobs were read right

    gen = read_samples(out, "shardserve_tiny_gen")
    assert [s["doc_id"] for s in gen] == list(range(len(gen_docs)))
    for s, doc in zip(gen, gen_docs):
        ids = tok.encode(doc["question"])
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=GEN_TOKENS, do_sample=False)[0, len(ids):]
        assert s["resps"] == [[tok.decode(want).split("\n")[0]]], doc

    posts = [e for e in proxy.exchanges if e.method == "POST"]
    scoring = [e for e in posts if e.body.get("echo")]
    assert len(scoring) == sum(len(d["choices"]) for d in mc_docs)
    assert len(posts) - len(scoring) == len(gen_docs)
