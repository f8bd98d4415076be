"""``graphspec serve``: an OpenAI-compatible HTTP server over the batched engine (FastAPI + uvicorn).

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the target's chat template), each plain or
  streamed as server-sent events ending in ``data: [DONE]``; ``GET /v1/models``, ``GET /health`` and
  ``GET /metrics`` (Prometheus text).
- Requests are pydantic models that forbid unknown fields: a field graphspec does not support (``n`` > 1,
  ``logprobs``, ``tools``, ``response_format`` ...) is a 400 naming it, never ignored. Errors have OpenAI's
  shape (``{"error": {"message", "type", "param", "code"}}``); a full queue is a 429 at once.
- Every response carries ``usage`` and, under ``graphspec``, that request's speculation: proposed and
  accepted draft tokens (also by draft position), tokens per target forward, forwards, time to first token.
- The server keeps no state between requests, so replicas behind a load balancer need nothing shared.
  It binds 127.0.0.1 unless told otherwise.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (local classes) at runtime.
import asyncio
import contextlib
import json
import signal
import threading
import time
import uuid
from typing import Any, Literal, Optional, Union

from graphspec.engine import FINISHED, Engine, QueueFull

__all__ = ["create_app", "serve", "background", "Metrics"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _models():
    """The request models, built on first use so that importing graphspec never needs pydantic."""
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

    class _Base(BaseModel):
        model_config = ConfigDict(extra="forbid")

        model: Optional[StrictStr] = None
        max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
        max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
        temperature: Optional[float] = Field(default=None, ge=0.0, le=100.0)
        top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
        top_k: Optional[StrictInt] = Field(default=None, ge=-1)
        seed: Optional[StrictInt] = Field(default=None, ge=0, lt=1 << 64)
        stop: Optional[Union[StrictStr, list[StrictStr]]] = None
        stream: StrictBool = False
        stream_options: Optional[dict[str, StrictBool]] = None
        n: StrictInt = 1
        ignore_eos: StrictBool = False
        user: Optional[StrictStr] = None
        # OpenAI fields graphspec does not implement: accepted only at their "off" values.
        logprobs: Optional[Any] = None
        top_logprobs: Optional[Any] = None
        logit_bias: Optional[Any] = None
        presence_penalty: Optional[float] = None
        frequency_penalty: Optional[float] = None
        best_of: Optional[Any] = None

        @field_validator("n")
        @classmethod
        def _one(cls, v):
            if v != 1:
                raise ValueError("graphspec returns one choice per request: n must be 1")
            return v

        @field_validator("stop")
        @classmethod
        def _stops(cls, v):
            if isinstance(v, list) and (len(v) > 16 or any(s == "" for s in v)):
                raise ValueError("stop takes at most 16 non-empty strings")
            if v == "":
                raise ValueError("stop must not be empty")
            return v

        @field_validator("stream_options")
        @classmethod
        def _options(cls, v):
            if v is not None and set(v) - {"include_usage"}:
                raise ValueError(f"stream_options supports include_usage only, got {sorted(v)}")
            return v

        def unsupported(self) -> str | None:
            """The first field set to a value graphspec does not implement, or None."""
            for name in ("logprobs", "top_logprobs", "logit_bias", "best_of"):
                v = getattr(self, name)
                if v not in (None, False, 0, {}, 1 if name == "best_of" else None):
                    return name
            for name in ("presence_penalty", "frequency_penalty"):
                if getattr(self, name) not in (None, 0, 0.0):
                    return name
            return None

    class CompletionRequest(_Base):
        prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
        echo: StrictBool = False
        suffix: Optional[StrictStr] = None

    class Message(BaseModel):
        model_config = ConfigDict(extra="forbid")
        role: Literal["system", "user", "assistant", "developer"]
        content: StrictStr
        name: Optional[StrictStr] = None

    class ChatRequest(_Base):
        messages: list[Message] = Field(min_length=1)
        tools: Optional[Any] = None
        tool_choice: Optional[Any] = None
        functions: Optional[Any] = None
        function_call: Optional[Any] = None
        response_format: Optional[Any] = None
        parallel_tool_calls: Optional[Any] = None

        def unsupported(self) -> str | None:
            for name in ("tools", "tool_choice", "functions", "function_call", "response_format",
                         "parallel_tool_calls"):
                if getattr(self, name) not in (None, "none"):
                    return name
            return super().unsupported()

    return CompletionRequest, ChatRequest


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series: counters read as totals
        self.registry = r = CollectorRegistry()
        self.requests = Counter("graphspec_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("graphspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("graphspec_prompt_tokens_cached", "Prompt tokens of finished requests "
                                            "whose target KV rows came from the prefix cache", registry=r)
        self.generation_tokens = Counter("graphspec_generation_tokens", "Tokens generated (finished or cancelled)",
                                         registry=r)
        self.proposed = Counter("graphspec_draft_tokens_proposed", "Draft tokens proposed", registry=r)
        self.accepted = Counter("graphspec_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.proposed_by_position = Counter("graphspec_draft_proposed_by_position",
                                            "Draft tokens proposed, by draft position (0 = first)", ["position"],
                                            registry=r)
        self.accepted_by_position = Counter("graphspec_draft_accepted_by_position",
                                            "Draft tokens accepted, by draft position (0 = first)", ["position"],
                                            registry=r)
        self.target_forwards = Counter("graphspec_target_forwards", "Target forwards of finished requests "
                                       "(prefill included; a batched forward counts once per request in it)",
                                       registry=r)
        self.acceptance = Gauge("graphspec_acceptance_rate", "Accepted / proposed draft tokens so far", registry=r)
        self.acceptance.set_function(lambda: self._ratio(self.accepted, self.proposed))
        self.per_forward = Gauge("graphspec_tokens_per_target_forward",
                                 "Generated tokens per target forward so far (decode steps)", registry=r)
        self.per_forward.set_function(lambda: self._per_forward())
        self._decode_tokens = 0
        self._decode_forwards = 0
        running = Gauge("graphspec_running_sequences", "Sequences in the batch now", registry=r)
        running.set_function(lambda: engine.running)
        waiting = Gauge("graphspec_queue_length", "Requests waiting for a slot", registry=r)
        waiting.set_function(lambda: engine.waiting)
        self.ttft = Histogram("graphspec_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tpot = Histogram("graphspec_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

    @staticmethod
    def _ratio(num, den) -> float:
        d = den._value.get()
        return num._value.get() / d if d else 0.0

    def _per_forward(self) -> float:
        return self._decode_tokens / self._decode_forwards if self._decode_forwards else 0.0

    def record(self, endpoint: str, seq, result, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()
        if result is None:
            return
        s = result.stats
        self.prompt_tokens.inc(len(result.prompt_token_ids))
        self.cached_prompt_tokens.inc(s.cached_prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self.proposed.inc(s.proposed)
        self.accepted.inc(s.accepted)
        for i, (p, a) in enumerate(zip(s.proposed_per_position, s.accepted_per_position)):
            if p:
                self.proposed_by_position.labels(str(i)).inc(p)
                self.accepted_by_position.labels(str(i)).inc(a)
        self.target_forwards.inc(s.target_forwards)
        self._decode_tokens += len(result.token_ids)
        self._decode_forwards += max(s.target_forwards - 1, 0)
        if seq.first_token_at is not None:
            self.ttft.observe(seq.first_token_at - seq.submitted)
            n = len(result.token_ids)
            if n > 1 and seq.finished_at is not None:
                self.tpot.observe((seq.finished_at - seq.first_token_at) / (n - 1))


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def _stats(seq, result) -> dict:
    s = result.stats
    return {"proposed_draft_tokens": s.proposed, "accepted_draft_tokens": s.accepted,
            "acceptance_rate": s.acceptance_rate, "tokens_per_target_forward": s.mean_accepted_length,
            "target_forwards": s.target_forwards, "draft_forwards": s.draft_forwards,
            "proposed_by_position": list(s.proposed_per_position),
            "accepted_by_position": list(s.accepted_per_position),
            "tested_by_position": list(s.tested_per_position),
            "time_to_first_token_s": (None if seq.first_token_at is None else seq.first_token_at - seq.submitted),
            "seconds": (seq.finished_at or time.perf_counter()) - seq.submitted}


def _usage(result) -> dict:
    p, c = len(result.prompt_token_ids), len(result.token_ids)
    # OpenAI's shape: prompt tokens served from the prefix cache (``graphspec serve --prefix-cache``)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_prompt_tokens}}


def create_app(engine: Engine, model_name: str, default_max_tokens: int = 256):
    """The FastAPI app serving ``engine`` as ``model_name``. Completions default to 16 new tokens (as
    OpenAI's), chat to ``default_max_tokens``; a request may ask for more up to the context length."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    CompletionRequest, ChatRequest = _models()
    metrics = Metrics(engine)
    created = int(time.time())
    tokenizer = engine.pipeline.tokenizer
    context = engine.pipeline.target.config.max_position_embeddings

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close(timeout=10.0)

    app = FastAPI(title="graphspec", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [x for x in first.get("loc", ()) if x != "body"]
        forms = []  # a field of several allowed types reports each ("prompt", "str"), ("prompt", "list[int]")
        for e in errors:
            eloc = [x for x in e.get("loc", ()) if x != "body"]
            if eloc and len(eloc) == len(loc) and eloc[:-1] == loc[:-1] and isinstance(eloc[-1], str) and (
                    "[" in eloc[-1] or eloc[-1] in ("str", "int", "float", "bool")):
                forms.append(eloc[-1].split("-")[0])
        if len(forms) > 1:
            param = ".".join(str(x) for x in loc[:-1])
            return _error(400, f"{param}: expected one of {', '.join(forms)}", param)
        param = ".".join(str(x) for x in loc) or None
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})")
        if first.get("type") == "extra_forbidden":
            return _error(400, f"field {param!r} is not supported by graphspec", param, code="unsupported_field")
        msg = first.get("msg", "invalid request")
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        return _error(400, f"{param or 'body'}: {msg}{more}", param)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "graphspec", "max_model_len": context}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check(req):
        if req.model is not None and req.model != model_name:
            return _error(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                          "model", code="model_not_found")
        bad = req.unsupported()
        if bad is not None:
            return _error(400, f"field {bad!r} is not supported by graphspec", bad, code="unsupported_field")
        return None

    def sampling(req, default_tokens: int) -> dict:
        temperature = 1.0 if req.temperature is None else req.temperature
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        max_tokens = req.max_completion_tokens or req.max_tokens or default_tokens
        return dict(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k,
                    top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=req.stop,
                    ignore_eos=req.ignore_eos)

    async def generate(request: Request, req, prompt, endpoint: str, default_tokens: int, chat: bool):
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        kw = sampling(req, default_tokens)
        try:
            seq = engine.submit(prompt, **kw, on_piece=lambda item: loop.call_soon_threadsafe(pieces.put_nowait, item))
        except QueueFull as e:
            metrics.requests.labels(endpoint, "rejected").inc()
            return _error(429, str(e), kind="rate_limit_error", code="queue_full")
        except ValueError as e:
            metrics.requests.labels(endpoint, "invalid").inc()
            return _error(400, str(e).splitlines()[0] if len(str(e)) > 2000 else str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())

        def finished(outcome: str):
            result = seq._result
            metrics.record(endpoint, seq, result, outcome)

        if not req.stream:
            text = []
            while True:
                try:
                    item = await asyncio.wait_for(pieces.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        seq.cancel()
                    continue
                if item is FINISHED:
                    break
                text.append(item)
            if seq._error is not None:
                finished("error")
                return _error(500, f"generation failed: {seq._error}", kind="server_error")
            result = seq._result
            if result is None:  # cancelled: the client is gone
                finished("cancelled")
                return _error(499, "request cancelled", kind="cancelled")
            finished("finished")
            reason = _FINISH[result.finish_reason]
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                          "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": result.text, "finish_reason": reason, "logprobs": None}
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                    "model": model_name, "choices": [choice], "usage": _usage(result),
                    "graphspec": _stats(seq, result)}

        include_usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None = None, role: bool = False, extra: dict | None = None) -> str:
            if chat:
                d: dict = {}
                if role:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            body = {"id": rid, "object": kind, "created": now, "model": model_name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            if extra:
                body.update(extra)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        async def events():
            outcome = "cancelled"
            try:
                if chat:
                    yield chunk("", role=True)
                while True:
                    item = await pieces.get()
                    if item is FINISHED:
                        break
                    yield chunk(item)
                if seq._error is not None:
                    outcome = "error"
                    err = {"error": {"message": f"generation failed: {seq._error}", "type": "server_error",
                                     "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                elif seq._result is not None:
                    outcome = "finished"
                    result = seq._result
                    yield chunk(None if chat else "", _FINISH[result.finish_reason],
                                extra={"graphspec": _stats(seq, result)})
                    if include_usage:
                        body = {"id": rid, "object": kind, "created": now, "model": model_name, "choices": [],
                                "usage": _usage(result)}
                        yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): stop the sequence, free its slot
                seq.cancel()
                seq.add_done_callback(lambda _: finished(outcome))

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        bad = check(req)
        if bad is not None:
            return bad
        if req.echo or req.suffix:
            return _error(400, f"field {'echo' if req.echo else 'suffix'!r} is not supported by graphspec",
                          "echo" if req.echo else "suffix", code="unsupported_field")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return _error(400, "prompt: graphspec takes one prompt per request (a string or token ids); "
                                   "send one request per prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt or prompt == "":
            return _error(400, "prompt is empty", "prompt")
        return await generate(request, req, prompt, "completions", 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest):
        bad = check(req)
        if bad is not None:
            return bad
        if tokenizer is None or not tokenizer.has_chat_template:
            return _error(400, "this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        return await generate(request, req, messages, "chat", default_max_tokens, chat=True)

    return app


@contextlib.contextmanager
def background(engine: Engine, model_name: str = "graphspec", host: str = "127.0.0.1", port: int = 0, **kwargs):
    """A server over ``engine`` in a background thread (``port=0``: a free one); yields its base URL and
    stops it on exit. For tests and benchmarks that talk to a server from the same process."""
    import socket

    import uvicorn

    app = create_app(engine, model_name, **kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            sock.close()
            raise RuntimeError("the background server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def serve(pipeline, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16, max_queue: int = 64,
          policy: str = "auto", model_name: str | None = None, default_max_tokens: int = 256,
          log_level: str = "info") -> None:
    """Serve ``pipeline`` until SIGINT/SIGTERM (uvicorn finishes in-flight requests, then the engine closes)."""
    import uvicorn

    engine = Engine(pipeline, max_batch=max_batch, max_queue=max_queue, policy=policy)
    if policy == "auto":
        engine.policy()  # measure the cost table before the first request
    name = model_name or getattr(pipeline.target, "name", None) or "graphspec"
    app = create_app(engine, name, default_max_tokens=default_max_tokens)

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # SIGINT/SIGTERM start the graceful shutdown; unlike uvicorn's own, this does not raise the
            # signal again afterwards, so a server stopped by SIGTERM exits with status 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    _Server(config).run()
