"""The FastAPI app: OpenAI routes, health, metrics, tokenize/detokenize."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from shardserve.chat_messages import TEXT_ONLY
from shardserve.http_common import answer_errors, cancel_on_disconnect, require_api_key
from shardserve.ipc.messages.api import DetokenizeReq, ErrorOut, TokenizeReq
from shardserve.loader.pooling import Pooling
from shardserve.openai_errors import ANTHROPIC_PATHS
from shardserve.server.anthropic_api import MessagesHandlers
from shardserve.server.anthropic_api import error_response as anthropic_error_response
from shardserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from shardserve.server.client import EngineClient
from shardserve.server.embeddings import EmbeddingRequest, embeddings
from shardserve.server.errors import APIError, parse_body
from shardserve.server.generation import Timeouts
from shardserve.server.lora_registry import LoadLoraRequest, LoraRegistry, UnloadLoraRequest
from shardserve.server.metrics import CountResponses, Metrics
from shardserve.server.openai_api import OpenAIHandlers
from shardserve.server.openapi import document_bodies
from shardserve.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from shardserve.server.reasoning import Reasoning
from shardserve.server.request_params import chat_options, check_token_ids, template_fields_given
from shardserve.server.response_store import ResponseStore
from shardserve.server.responses_api import ResponsesHandlers
from shardserve.server.responses_protocol import ResponsesRequest
from shardserve.server.tools import ToolFormat
from shardserve.server.turns import chat_messages, fetch_images
from shardserve.tokenizer.images import MediaFetch

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    client: EngineClient
    metrics: Metrics
    model_name: str
    max_model_len: int
    max_n: int = 16
    max_queued: int = 1024
    max_body: int = 8 * 2**20
    request_timeout: Timeouts = field(default_factory=Timeouts)  # engine silence, and --request-timeout
    sampling_defaults: dict = field(default_factory=dict)  # the model's, for fields a request leaves out
    api_key: str = field(default="", repr=False)  # "" = open; never printed
    metrics_require_key: bool = False  # also guard /health and /metrics
    max_prompts: int = 256  # prompts in one completions request
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string
    vocab_size: int | None = None  # logit_bias ids are checked against it (the engine checks again)
    tool_format: ToolFormat = field(default_factory=ToolFormat)  # how the model's tool calls are read back
    reasoning: Reasoning = field(default_factory=Reasoning)  # --reasoning-parser: thinking split off the answer
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored responses (--responses-max-stored*)
    pooling: Pooling = field(default_factory=lambda: Pooling("last"))  # how /v1/embeddings pools (--pooling)
    hidden_size: int = 0  # an embedding's full width
    # --trust-request-chat-template: a request's own Jinja template runs in a tokenizer worker, and one
    # that loops would stall it, so (as in vLLM) only a server started with this flag runs them.
    trust_request_chat_template: bool = False
    disaggregation_mode: str = "null"  # --disaggregation-mode
    images_refused: str = TEXT_ONLY  # why a chat's image part is refused ("": the model reads them)
    media: MediaFetch = MediaFetch()  # how images given by http(s) URL are fetched
    scheduling_policy: str = "fcfs"  # --scheduling-policy: whether a request's `priority` may be other than 0
    bootstrap_port: int | None = None  # where decode instances reach a prefill instance's leader
    loras: LoraRegistry | None = None  # --enable-lora: the adapters a request's `model` may name

    def __post_init__(self) -> None:
        if self.loras is None:
            self.loras = LoraRegistry(self.model_name, None, 0)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="shardserve", docs_url=None, redoc_url=None)
    api, anthropic = OpenAIHandlers(state), MessagesHandlers(state)
    responses = ResponsesHandlers(state, state.responses)

    @app.on_event("startup")
    async def _start() -> None:
        state.client.start()

    require_api_key(app, state.api_key, state.metrics_require_key)

    app.add_middleware(CountResponses, counter=state.metrics.http)  # outermost: 401s count too

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        """Each API's own error shape: Anthropic's on its Messages routes, OpenAI's elsewhere."""
        return anthropic_error_response(e) if request.url.path.startswith(ANTHROPIC_PATHS) else e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        return JSONResponse(error_body(str(e), 400), 400)

    answer_errors(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        prefill = prefill_address(state, request.headers.get(PREFILL_HEADER))
        body = await parse_body(request, CompletionRequest, state.max_body)
        return await cancel_on_disconnect(request, api.completions(body, prefill))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        prefill = prefill_address(state, request.headers.get(PREFILL_HEADER))
        body = await parse_body(request, ChatRequest, state.max_body)
        return await cancel_on_disconnect(request, api.chat(body, prefill))

    @app.post("/v1/embeddings")
    async def embed(request: Request):
        body = await parse_body(request, EmbeddingRequest, state.max_body)
        return await cancel_on_disconnect(request, embeddings(state, body))

    @app.post("/v1/responses")
    async def create_response(request: Request):
        prefill = prefill_address(state, request.headers.get(PREFILL_HEADER))
        body = await parse_body(request, ResponsesRequest, state.max_body)
        return await cancel_on_disconnect(request, responses.create(body, prefill))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return responses.cancel(response_id)

    @app.post("/v1/messages")
    async def messages(request: Request):
        prefill = prefill_address(state, request.headers.get(PREFILL_HEADER))
        body = await parse_body(request, MessagesRequest, state.max_body)
        return await cancel_on_disconnect(request, anthropic.create(body, prefill))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await parse_body(request, CountTokensRequest, state.max_body)
        return await anthropic.count_tokens(body)

    @app.get("/disaggregation")
    async def disaggregation():
        """What the PD router checks: this instance's role, and a prefill instance's bootstrap port."""
        port = state.bootstrap_port if state.disaggregation_mode == "prefill" else None
        return {"mode": state.disaggregation_mode, "bootstrap_port": port}

    @app.get("/v1/models")
    async def models():
        base = {"id": state.model_name, "object": "model", "owned_by": "shardserve",
                "max_model_len": state.max_model_len}
        return {"object": "list", "data": [base, *state.loras.cards(state.max_model_len)]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse_body(request, LoadLoraRequest, state.max_body)
        try:  # file reads off the event loop: a slow disk must not stall every other request
            await asyncio.to_thread(state.loras.load, body.lora_name, body.lora_path, body.load_inplace)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        log.info("LoRA adapter %r loaded from %s", body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request, UnloadLoraRequest, state.max_body)
        try:
            state.loras.unload(body.lora_name, body.lora_int_id)
        except KeyError:
            with_id = f" with lora_int_id {body.lora_int_id}" if body.lora_int_id is not None else ""
            raise APIError(404, f"no LoRA adapter named {body.lora_name!r}{with_id} is loaded",
                           param="lora_name") from None
        log.info("LoRA adapter %r unloaded (requests running with it finish first)", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    installed = {"version": metadata.version("shardserve")}  # read once, not per request

    @app.get("/version")
    async def version():
        return installed

    @app.get("/health")
    @app.get("/ping")  # what SageMaker's and vLLM's probes call; as /health
    @app.post("/ping")
    async def health():
        if state.client.dead:
            return JSONResponse(error_body(state.client.dead, 503), 503)
        board = state.client.board
        if len(board.replicas) == 1:
            return {"status": "ok"}
        # Several replicas: healthy while one serves; the body says which do.
        return JSONResponse(board.health(), 200 if board.serving else 503)

    @app.get("/metrics")
    async def metrics():
        state.metrics.update(state.client.stats, state.client.router_stats, state.client.board, state.client.retired)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest, state.max_body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        msgs = chat_messages(body.messages, state.images_refused) if body.messages is not None else None
        await fetch_images(state, msgs)
        if body.tools and msgs is None:
            raise APIError(400, "tools are rendered with chat messages: give 'messages'", param="tools")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        options = chat_options(body, msgs, state.trust_request_chat_template) if msgs is not None else None
        if msgs is None and (given := template_fields_given(body)):
            raise APIError(400, f"{given} shapes how chat messages are rendered: give 'messages'", param=given)
        reply = await state.client.call(TokenizeReq(rid=EngineClient.new_rid(), text=body.prompt, messages=msgs,
                                                    add_special_tokens=body.add_special_tokens, tools=tools,
                                                    chat_options=options))
        _raise_if_error(reply)
        return {"tokens": reply.token_ids, "count": len(reply.token_ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest, state.max_body)
        check_token_ids(body.tokens, state.vocab_size, "tokens")
        reply = await state.client.call(DetokenizeReq(rid=EngineClient.new_rid(), token_ids=body.tokens))
        _raise_if_error(reply)
        return {"prompt": reply.text}

    document_bodies(app, {
        "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest, "/v1/embeddings": EmbeddingRequest,
        "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest, "/v1/messages/count_tokens":
        CountTokensRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}, [state.model_name])
    return app


PREFILL_HEADER = "x-shardserve-prefill"  # the PD router names the prefill instance (tcp://HOST:PORT)


def prefill_address(state: ServerState, header: str | None) -> str:
    """The prefill instance a decode instance's request goes through, or a 400 where the request
    does not belong here."""
    mode = state.disaggregation_mode
    if mode == "prefill":
        raise APIError(400, "this server is a prefill instance (--disaggregation-mode prefill): it takes prompts "
                            "from decode instances only; send requests to the router in front of them")
    if mode == "null":
        if header is not None:
            raise APIError(400, "the X-Shardserve-Prefill header is for decode instances (--disaggregation-mode "
                                "decode)")
        return ""
    if header is None:
        raise APIError(400, "this server is a decode instance (--disaggregation-mode decode): send requests "
                            "through `shardserve router --prefill URL --decode URL`, which names the prefill "
                            "instance (X-Shardserve-Prefill)")
    host, _, port = header.removeprefix("tcp://").rpartition(":")
    if not header.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise APIError(400, f"X-Shardserve-Prefill must be tcp://HOST:PORT, got {header[:100]!r}")
    return header


def _raise_if_error(reply) -> None:
    if isinstance(reply, ErrorOut):
        raise APIError(reply.status, reply.message, reply.param)
