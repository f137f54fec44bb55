"""`echo serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn on uvloop).

Routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health, /version,
/metrics. Errors use OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from echo import __version__
from echo.engine.async_client import AsyncClient, EngineDeadError
from echo.engine.generation_config import GenerationDefaults
from echo.entrypoints.chat_output import ChatOutput
from echo.entrypoints.http_guards import ClientDisconnected, HTTPGuard, unless_disconnected
from echo.entrypoints.metrics import RequestTimer, ServerMetrics
from echo.entrypoints.openai_protocol import (
    NO_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeChatRequest,
    TokenizeRequest,
)
from echo.entrypoints.parsers import get_reasoning_parser, get_tool_parser
from echo.entrypoints.request_limits import RequestLimits
from echo.entrypoints.responses import (
    ChoiceState,
    EchoedPrompt,
    chunk_json,
    echo_prompts,
    final_json,
    usage_json,
)
from echo.entrypoints.tool_calls import ToolPlan
from echo.outputs import RequestOutput
from echo.sampling_params import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def bad_request(e: ValueError) -> APIError:
    """A 400 for a ValueError worded 'FIELD: message', as echo's checks word them."""
    message = str(e).removeprefix("SamplingParams.")
    field, sep, _ = message.partition(": ")
    return APIError(400, message, field if sep and " " not in field else None)


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


_ERROR_KINDS = {401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error",
                503: "service_unavailable"}
log = logging.getLogger("echo.api_server")


def longest_token_chars(tokenizer) -> int:
    """The most characters one token's text can hold (1 without a tokenizer: prompts are
    then token ids)."""
    return max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1


@dataclass(frozen=True)
class ServerOptions:
    """What `echo serve`'s flags set beyond the engine and the checks of every request."""

    generation_defaults: GenerationDefaults = NO_DEFAULTS  # --generation-config
    log_requests: bool = False
    # CORS, as vLLM's --allowed-origins/methods/headers and --allow-credentials
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    sse_ping_s: float = 15.0  # keep-alive comment interval of streamed responses
    # tools and reasoning: vLLM's --enable-auto-tool-choice, --tool-call-parser,
    # --reasoning-parser and --default-chat-template-kwargs
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict = field(default_factory=dict)

    def check(self) -> None:
        """ValueError naming the flag for a combination that cannot work."""
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)


def create_app(client: AsyncClient, served_model_names: list[str], api_key: str | None = None,
               max_request_bytes: int = 16 * 2**20,
               options: ServerOptions = ServerOptions()) -> FastAPI:
    app = FastAPI(title="echo", version=__version__)
    metrics = ServerMetrics(served_model_names[0], client.config.model.max_model_len,
                            client.num_replicas)
    max_model_len = client.config.model.max_model_len
    limits = RequestLimits.create(client.config.scheduler.max_num_seqs, max_model_len,
                                  longest_token_chars(client.tokenizer))
    app.add_middleware(HTTPGuard, error_response=error_response, api_key=api_key,
                       max_request_bytes=max_request_bytes)
    # outermost: a browser's preflight is answered before the API-key check, as in vLLM
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods),
                       allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        if first["type"] == "json_invalid":  # its loc is a character offset, not a field
            field = "body"
        message = str(first["msg"]).removeprefix("Value error, ")
        if field == "body" and ": " in message:  # a whole-body check names its own field
            field = message.split(": ", 1)[0]
            return error_response(400, message, field)
        return error_response(400, f"{field}: {message}", field)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # unknown routes, bodies that do not parse
        return error_response(e.status_code, str(e.detail),
                              kind=_ERROR_KINDS.get(e.status_code, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        error_id = uuid.uuid4().hex
        log.error("internal error %s on %s %s", error_id, request.method, request.url.path,
                  exc_info=e)
        return error_response(500, f"internal error {error_id} (logged by the server)",
                              kind="internal_server_error")

    def check_model(name: str | None) -> str:
        if name is not None and name not in served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model",
                           "not_found_error")
        return served_model_names[0]

    async def check_engine() -> None:
        if not await client.health():
            raise APIError(503, "the engine is not running", kind="service_unavailable")

    def check_request(body) -> None:
        """Once per request, before any prompt is templated or tokenized."""
        field = body.unsupported()
        if field:
            raise APIError(400, f"{field}: not supported by this server", field)
        try:
            limits.check_sampling(body)
            client.config.scheduler.check_priority(body.priority)
        except ValueError as e:
            raise bad_request(e) from None

    reasoning = (get_reasoning_parser(options.reasoning_parser)()
                 if options.reasoning_parser else None)
    # a structured output applies after the reasoning: the tags' token ids tell the engine
    reasoning_ids = reasoning_token_ids(client.tokenizer, reasoning) if reasoning else None

    def prepare(prompt, body, max_tokens: int | None, logprobs: int | None):
        try:
            _, ids = client.input_processor.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        try:
            params = body.sampling_params(max_tokens, logprobs, options.generation_defaults)
            ids = client.input_processor.truncate(ids, params)
            if reasoning_ids is not None and params.structured_outputs is not None:
                params.structured_outputs.reasoning_token_ids = reasoning_ids
            constraint = body.structured_constraint()  # a grammar error names its field
            # a max_tokens the client gave must fit (OpenAI's 400); a default one (the
            # generation config's max_new_tokens) stops at max_model_len instead, as in vLLM
            client.input_processor.validate(
                ids, params, max_tokens_must_fit=max_tokens is not None,
                structured_field=body.grammar_field(constraint[0]) if constraint else None)
        except ValueError as e:
            raise bad_request(e) from None
        return ids, params

    async def stream_outputs(ids: list[int], params: SamplingParams, request_id: str,
                             priority: int = 0) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(metrics, len(ids), params.n)
        try:
            async for out in client.generate(ids, params, request_id, priority):
                timer.engine = client.replica_of(request_id)
                timer.on_output(out)
                yield out
        except EngineDeadError as e:
            timer.end("error")
            raise APIError(503, f"the engine died: {e}", kind="service_unavailable") from None
        except ValueError as e:  # the engine refused the request (a limit only it knows)
            timer.end("error")
            raise bad_request(e) from None
        except Exception:
            timer.end("error")
            raise
        finally:
            timer.end("abort")  # stopped early: the client left (a no-op once it finished)

    async def serve(request: Request, kind: str, body, prompts: list, max_tokens: int | None,
                    logprobs: int | None, chat: bool, tools: ToolPlan | None = None):
        await check_engine()
        model = check_model(body.model)
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt")
        prepared = [prepare(p, body, max_tokens, logprobs) for p in prompts]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        def chat_output() -> ChatOutput | None:  # one per choice: each streams on its own
            tool_parser = tools.parser(options.tool_call_parser) if tools else None
            if reasoning is None and tool_parser is None:
                return None
            return ChatOutput(reasoning, tool_parser)

        tool_calls_finish = tools is not None and tools.mode in ("auto", "required")
        states = [ChoiceState(i * body.n + c, client.tokenizer, chat, body.return_token_ids,
                              chat_output() if chat else None, tool_calls_finish,
                              body.return_tokens_as_token_ids)
                  for i in range(len(prepared)) for c in range(body.n)]
        streams = [stream_outputs(ids, params, f"{request_id}-{i}", body.priority)
                   for i, (ids, params) in enumerate(prepared)]
        prompt_tokens = sum(len(ids) for ids, _ in prepared)
        if not chat and (body.echo or body.prompt_logprobs is not None):
            streams = echo_prompts(body, prompts, prepared, states, streams, client.tokenizer)
        elif chat and (echoed := body.echoed_text()):
            for state in states:
                state.prompt = EchoedPrompt(echoed, [], echo=True)
        if options.log_requests:
            for i, (ids, params) in enumerate(prepared):
                log.info("request %s-%d: %d prompt tokens, %s", request_id, i, len(ids), params)
        if body.stream:
            stream_options = body.stream_options or StreamOptions()
            plan = StreamPlan(kind, request_id, created, model, body.n, chat, prompt_tokens,
                              stream_options.include_usage,
                              stream_options.continuous_usage_stats)
            # keep-alive comments let proxies keep a stream open while it waits in the queue
            return EventSourceResponse(sse(plan, streams, states), ping=options.sse_ping_s,
                                       sep="\n")
        try:
            finals = await unless_disconnected(request,
                                               asyncio.gather(*(drain(s) for s in streams)))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it: the requests were aborted
        cached = sum(f.num_cached_tokens for f in finals)
        for i, final in enumerate(finals):
            for c, completion in enumerate(final.outputs):
                states[i * body.n + c].absorb(completion)
        return JSONResponse(final_json(kind, request_id, created, model, states,
                                       usage_json(prompt_tokens, states, cached)))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_request(body)
        prompts = body.prompts()
        try:
            limits.check_prompts(prompts, body.n)
        except ValueError as e:
            raise bad_request(e) from None
        return await serve(request, "text_completion", body, prompts, body.max_tokens,
                           body.logprobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        check_request(body)
        try:
            tools = body.tool_plan()
        except ValueError as e:
            raise bad_request(e) from None
        if tools.mode == "auto" and not options.enable_auto_tool_choice:
            raise APIError(400, 'tool_choice: "auto" needs the server started with '
                           "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        try:
            messages = body.message_dicts()
            limits.check_messages(messages)
            template_kwargs = {**options.default_chat_template_kwargs, **body.template_kwargs()}
            ids = client.input_processor.chat_to_ids(messages, **template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await serve(request, "chat.completion", body, [ids], body.limit(), logprobs,
                           chat=True, tools=tools)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "echo",
                "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in served_model_names]}

    # OpenAI's retrieve (client.models.retrieve): a name may hold slashes ("org/model")
    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card(name)

    @app.get("/health")
    async def health():
        if not await client.health():
            return error_response(503, "the engine is not running", kind="service_unavailable")
        states = client.replica_states()
        if any(state != "serving" for state in states):  # data parallel, some replica down
            return JSONResponse({"status": "degraded", "replicas": states})
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # vLLM's (SageMaker's) liveness route
        return await health()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeRequest):
        check_model(body.model)
        try:
            if isinstance(body, TokenizeChatRequest):
                messages = body.message_dicts()
                limits.check_messages(messages)
                # the prompt chat completions would build: the server's defaults too
                text = client.input_processor.apply_chat_template(
                    messages, **{**options.default_chat_template_kwargs,
                                 **body.template_kwargs()})
            else:
                if body.prompt is None:
                    raise ValueError("prompt: give a prompt or messages")
                limits.check_text(body.prompt, "prompt")
                text = body.prompt
            tokenizer = client.input_processor.need_tokenizer("prompt")
            ids = list(tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
        except ValueError as e:
            raise bad_request(e) from None
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        try:
            limits.check_token_count(body.tokens, "tokens")
            client.input_processor.check_token_ids(body.tokens, "tokens")
            text = client.input_processor.need_tokenizer("tokens").decode(body.tokens)
        except ValueError as e:
            raise bad_request(e) from None
        return {"prompt": text}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(client.replica_stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def reasoning_token_ids(tokenizer, parser) -> list[int]:
    """The token ids of a reasoning parser's tags; ValueError naming the flag when the
    tokenizer does not hold each as one token (the engine gates a grammar on them)."""
    ids = []
    for tag in (parser.start_tag, parser.end_tag):
        token_id = tokenizer.convert_tokens_to_ids(tag) if tokenizer is not None else None
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"--reasoning-parser: the tokenizer has no token {tag!r}")
        ids.append(token_id)
    return ids


async def drain(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    return final


@dataclass(frozen=True)
class StreamPlan:
    """What one streamed response's chunks carry besides its choices."""

    kind: str  # "text_completion" or "chat.completion"
    request_id: str
    created: int
    model: str
    n: int
    chat: bool
    prompt_tokens: int
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool  # vLLM's continuous_usage_stats: the usage so far on every chunk


async def sse(plan: StreamPlan, streams, states) -> AsyncIterator[dict]:
    """Server-sent events: one chunk per output of each prompt, merged as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - surfaced to the client below
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    chunk_kind = "chat.completion.chunk" if plan.chat else "text_completion"
    cached, open_streams = 0, len(tasks)

    def chunk(choice: dict) -> dict:
        body = chunk_json(chunk_kind, plan.request_id, plan.created, plan.model, choice)
        if plan.continuous_usage:
            body["usage"] = usage_json(plan.prompt_tokens, states, cached)
        return data(body)

    try:
        if plan.chat:
            for state in states:
                yield chunk(state.role_delta())
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                if isinstance(item, APIError):  # e.g. the engine refused it: a 400's kind
                    error = {"message": item.message, "type": item.kind, "code": item.status}
                else:
                    error = {"message": str(item), "type": "internal_error", "code": 500}
                yield data({"error": error})
                break
            cached += item.num_cached_tokens if item.finished else 0
            for c, completion in enumerate(item.outputs):
                choice = states[i * plan.n + c].delta(completion)
                if choice is not None:
                    yield chunk(choice)
        if plan.include_usage:
            usage = usage_json(plan.prompt_tokens, states, cached)
            yield data({"id": plan.request_id, "object": chunk_kind, "created": plan.created,
                        "model": plan.model, "choices": [], "usage": usage})
        yield {"data": "[DONE]"}
    finally:
        for task in tasks:  # a disconnected client cancels its requests
            task.cancel()


def data(obj) -> dict:
    """One server-sent event (sse-starlette frames it)."""
    return {"data": json.dumps(obj, separators=(",", ":"))}
