from __future__ import annotations

import pytest
from server_util import Server


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tmp_path_factory):
    """A live server on the tiny Llama (with its tiny BPE tokenizer)."""
    path, model = tiny_model("llama")
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    server = Server("--model", path, "--num-pages", "256", "--page-size", "8", "--max-queued-requests", "200",
                    "--trust-request-chat-template", log_path=log)
    server.model = model
    server.model_path = path
    yield server
    code, left = server.stop()
    assert left == [], f"processes left behind: {left}"
    assert code == 0, server.read_log()[-3000:]
