"""The HTTP API fuzzed from its own OpenAPI document (schemathesis, bounded examples): no body,
valid by the schema or not, gets a 5xx, and the server still serves afterwards."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest
from server_util import Server

pytestmark = pytest.mark.slow


def test_no_generated_body_gets_a_server_error(tiny_model, tmp_path):
    st = shutil.which("st")
    if st is None:
        pytest.fail("schemathesis missing: pip install -e '.[test]'")
    path, _ = tiny_model("llama")
    # A short context, so that a generated max_tokens or n runs quickly or is refused.
    server = Server("--model", path, "--num-pages", "64", "--page-size", "8", "--max-model-len", "64",
                    log_path=str(tmp_path / "server.log"))
    try:
        doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
        body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
        run = subprocess.run(
            [st, "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
             "--phases", "examples,fuzzing", "--seed", "7", "--workers", "1", "--request-timeout", "60",
             "--generation-database", "none", "--no-color", "--suppress-health-check", "all"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        operations = sum(len(methods) for methods in doc["paths"].values())
        assert re.search(rf"Tested: {operations}\b", out), out[-3000:]  # every route was fuzzed
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200, health.text
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        code, left = server.stop()
    assert code == 0 and left == [], server.read_log()[-3000:]
