"""`TriForceServer`: the Ray Serve deployment, an OpenAI-compatible FastAPI app per replica.

Each replica holds the model, its `Engine` (TriForce, a `PrefixStore` of its own) and one generation thread, the
`Scheduler`, which decodes the replica's concurrent requests together as one batch; Ray Serve's HTTP proxy spreads
requests over the replicas. A replica runs at the niceness of the command that started the server (Ray starts its
workers at nice 15, where any other process on the machine starves them).

A request carrying the header ``serve_multiplexed_model_id: <document id>`` goes to a replica that has served that
document before (Ray Serve's model multiplexing, with the document id as the "model"), where its prefilled prefix is
stored; one without it goes to any replica.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or not), ``GET /v1/models``,
``GET /health``, ``GET /v1/triforce/store`` (this replica's store, its host and process), ``GET /v1/triforce/replica``
(its niceness, batch size and its latest batches' figures, TriForce's statistics among them). Every response names the
replica that answered in the header ``x-triforce-replica`` (``<host>:<process id>``).
"""


import asyncio
import json
import os
import socket
import uuid
from dataclasses import dataclass, fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from .engine import Answer, Cancelled, Engine
from .requests import BadRequest, Parsed, RequestParser
from .responses import DONE, ChatResponses, TextResponses, error_body, error_event, usage

REPLICA_HEADER = "x-triforce-replica"

# Ray Serve's class ingress takes the app where the class is defined; each replica process holds its own copy
app = FastAPI(title="hf-triforce")
DOCUMENTS_PER_REPLICA = 1024  # document ids a replica is routed before Ray Serve forgets its least recent


@app.exception_handler(BadRequest)
async def _bad_request(_request: Request, error: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(str(error)), status_code=400)


@dataclass(frozen=True)
class ServerSettings:
    """What each replica loads and how it serves (the ``hf-triforce serve`` options).

    model: a bundled model name (`hf_triforce.assets.MODELS`) or a model folder present on every node.
    served_name: the name requests give as ``model`` (default: ``model``).
    triforce: the server's `TriForceConfig` fields as a JSON object, or ``"off"`` for plain decoding.
    store_bytes / min_prefix_tokens: the prefix store's budget and shortest reused prefix (`PrefixStore`).
    threads: torch threads per replica (None: torch's default).
    dtype: the model's dtype (``"float32"``, ``"bfloat16"``).
    max_batch_size: concurrent requests a replica decodes as one batch at most (1: one at a time).
    niceness: the replica's niceness (None: as Ray started it); `launch` gives the starting command's own.
    """

    model: str
    served_name: str | None = None
    triforce: str = "{}"
    store_bytes: int = 4 << 30
    min_prefix_tokens: int = 256
    threads: int | None = None
    dtype: str = "float32"
    max_batch_size: int = 8
    niceness: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be one of float32, bfloat16, got {self.dtype!r}")


def take_niceness(niceness: int | None) -> None:
    """Run this process at ``niceness``; raises RuntimeError naming the fix where the system refuses it (a process
    may raise its niceness, lowering it needs privilege)."""
    if niceness is None or os.getpriority(os.PRIO_PROCESS, 0) == niceness:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except PermissionError as error:
        raise RuntimeError(f"the replica runs at nice {os.getpriority(os.PRIO_PROCESS, 0)} (the Ray worker "
                           f"niceness of its node) and may not lower it to {niceness}: start the node's Ray with "
                           f"RAY_worker_niceness={niceness} (e.g. `RAY_worker_niceness={niceness} ray start ...`)"
                           ) from error

def triforce_setting(text: str):
    """The server's TriForce configuration from its option: ``"off"`` (None) or a JSON object of fields."""
    from ..config import TriForceConfig

    if text.strip() == "off":
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--triforce-config: not JSON ({error}): {text!r}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"--triforce-config must be a JSON object of TriForceConfig fields or 'off', got {text!r}")
    return TriForceConfig.from_dict(fields)


class Detokenizer:
    """A stream's text, piece by piece, at a constant cost per token: the Rust tokenizer's ``DecodeStream`` (what
    `transformers serve` streams with), special tokens skipped; a piece ending inside a multi-byte character is
    held back until the character is whole."""

    def __init__(self, tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        from ..compat import rust_tokenizer

        self.backend, self.stream = rust_tokenizer(tokenizer), DecodeStream(skip_special_tokens=True)

    def add(self, token: int) -> str:
        return self.stream.step(self.backend, token) or ""


@serve.deployment(max_ongoing_requests=16, health_check_period_s=5, health_check_timeout_s=30)
@serve.ingress(app)
class TriForceServer:
    """One replica (see the module's docstring)."""

    def __init__(self, settings: ServerSettings) -> None:
        import torch

        from ..assets import load_model
        from ..integration import enable
        from .prefix_store import PrefixStore
        from .scheduler import Scheduler

        take_niceness(settings.niceness)
        enable()  # triforce_config= on generate, in this replica's process
        if settings.threads:
            torch.set_num_threads(settings.threads)
        model, tokenizer = load_model(settings.model, getattr(torch, settings.dtype))
        self.model_id = settings.served_name or settings.model
        why_not = PrefixStore.supports(model.config)
        store = None if why_not else PrefixStore(settings.store_bytes, settings.min_prefix_tokens, model.config)
        self.store_note = why_not or "on"
        self.engine = Engine(model, tokenizer, store)
        self.parser = RequestParser(self.model_id, tokenizer, model.generation_config, self.engine.context_length,
                                    triforce_setting(settings.triforce))
        Detokenizer(tokenizer)  # a tokenizer that cannot stream fails the start, not a request
        self.scheduler = Scheduler(self.engine, settings.max_batch_size)
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    @serve.multiplexed(max_num_models_per_replica=DOCUMENTS_PER_REPLICA)
    async def document(self, document_id: str) -> str:
        """Registers a document id with this replica, so that Ray Serve routes its next requests here."""
        return document_id

    async def _route(self) -> None:
        document = serve.get_multiplexed_model_id()
        if document:
            await self.document(document)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        await self._route()
        parsed = self.parser.chat_request(await request.json())
        return await self._answer(parsed, ChatResponses(f"chatcmpl-{uuid.uuid4().hex}", self.model_id))

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        await self._route()
        parsed = self.parser.completion_request(await request.json())
        return await self._answer(parsed, TextResponses(f"cmpl-{uuid.uuid4().hex}", self.model_id))

    @app.get("/v1/models")
    async def models(self):
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                                          "owned_by": "hf-triforce"}]},
                            headers={REPLICA_HEADER: self.replica})

    @app.get("/health")
    async def health(self):
        return JSONResponse({"status": "ok"}, headers={REPLICA_HEADER: self.replica})

    @app.get("/v1/triforce/store")
    async def store(self):
        described = self.engine.store.describe() if self.engine.store is not None else {"off": self.store_note}
        return JSONResponse({"replica": self.replica, "store": described}, headers={REPLICA_HEADER: self.replica})

    @app.get("/v1/triforce/replica")
    async def replica_figures(self):
        import ray

        return JSONResponse({"replica": self.replica, "node": ray.get_runtime_context().get_node_id(),
                             "niceness": os.getpriority(os.PRIO_PROCESS, 0),
                             "max_batch_size": self.scheduler.max_batch_size, "batches": list(self.engine.batches)},
                            headers={REPLICA_HEADER: self.replica})

    def _start(self, parsed: Parsed, on_token) -> asyncio.Future:
        return asyncio.wrap_future(self.scheduler.submit(parsed.job, on_token))

    async def _answer(self, parsed: Parsed, responses):
        headers = {REPLICA_HEADER: self.replica}
        prompt_tokens = parsed.job.ids.shape[1]
        if not parsed.stream:
            try:
                answer: Answer = await self._start(parsed, None)
            except ValueError as error:  # refused by generate: the request's values
                return JSONResponse(error_body(str(error)), status_code=400, headers=headers)
            except asyncio.CancelledError:
                parsed.job.cancelled.set()
                raise
            text = self.engine.tokenizer.decode(answer.tokens, skip_special_tokens=True)
            block = usage(prompt_tokens, len(answer.tokens), answer.figures)
            return JSONResponse(responses.body(text, answer.finish_reason, block), headers=headers)
        return StreamingResponse(self._events(parsed, responses), media_type="text/event-stream", headers=headers)

    async def _events(self, parsed: Parsed, responses):
        """The stream: a chunk per decoded piece, the finishing chunk, the usage chunk if asked, ``[DONE]``; an
        error event (and no finishing chunk) where the generation fails."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        detokenizer = Detokenizer(self.engine.tokenizer)
        future = self._start(parsed, lambda token: loop.call_soon_threadsafe(tokens.put_nowait, token))
        try:
            first = responses.first()
            if first is not None:
                yield first
            while True:
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                piece = detokenizer.add(getter.result())
                if piece:
                    yield responses.chunk(text=piece)
            while not tokens.empty():  # tokens queued before the generation ended
                piece = detokenizer.add(tokens.get_nowait())
                if piece:
                    yield responses.chunk(text=piece)
            try:
                answer: Answer = future.result()
            except Cancelled:
                return
            except Exception as error:  # the request failed: the client gets an error, never a finished answer
                yield error_event(f"{type(error).__name__}: {error}")
                return
            yield responses.chunk(finish_reason=answer.finish_reason)
            if parsed.include_usage:
                yield responses.chunk(usage_block=usage(parsed.job.ids.shape[1], len(answer.tokens), answer.figures))
            yield DONE
        finally:  # the client left (or the stream ended): stop a generation still running
            parsed.job.cancelled.set()


def settings_from_args(args: dict) -> ServerSettings:
    """`ServerSettings` from ``args`` (field name to value; values may be strings, as ``serve run`` passes them:
    integers parsed, ``"none"`` None); ``niceness`` defaults to this process's own. Raises ValueError naming an
    unknown field or a value of the wrong kind."""
    known = {f.name: f for f in fields(ServerSettings)}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; the arguments are ServerSettings fields {sorted(known)}")
    if "model" not in args:
        raise ValueError("the argument 'model' is required (a bundled model name or a model folder)")
    values = {}
    for name, value in args.items():
        if isinstance(value, str) and value.lower() == "none":
            value = None
        elif isinstance(value, str) and "int" in str(known[name].type):
            try:
                value = int(value)
            except ValueError as error:
                raise ValueError(f"{name} must be an integer, got {value!r}") from error
        values[name] = value
    values.setdefault("niceness", os.getpriority(os.PRIO_PROCESS, 0))
    settings = ServerSettings(**values)
    triforce_setting(settings.triforce)
    return settings


def build_app(args: dict) -> serve.Application:
    """The application, for ``serve run hf_triforce.serving.deployment:build_app model=smollm2-135m`` and Ray
    Serve config files (``import_path: hf_triforce.serving.deployment:build_app``, ``args: {model: ...}``): ``args``
    are `ServerSettings` fields (`settings_from_args`); the replicas run at the niceness of the process building
    the application (the ``serve run`` command's)."""
    return TriForceServer.bind(settings_from_args(args))
