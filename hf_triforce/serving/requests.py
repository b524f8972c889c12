"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) to `Job` s, checked.

Each body is validated by its typed model (`hf_triforce.serving.request_models`): a field outside the OpenAI schema
of `transformers serve` is refused with HTTP 422, as there; each value the server cannot honour with HTTP 400 and a
message naming the field (`BadRequest`): a model it does not serve, ``n`` other than 1, a negative temperature, an
unknown or invalid ``triforce`` field. Then `transformers serve`'s own handlers (transformers 5.24-5.25,
``transformers.cli.serving``, reached through `hf_triforce.compat.ServeRequestHandling`) render the chat template and
map the OpenAI fields of the body as it came to ``generate`` arguments (``max_tokens``, ``stop`` as
``stop_strings``, ``frequency_penalty``, ``logit_bias``, ``seed``, the default of at least 1024 new tokens); a prompt
that leaves no room in the model's context is refused with HTTP 400.

Extensions of the OpenAI body: ``triforce``: ``false`` (plain decoding, the baseline) or an object of
`TriForceConfig` fields (``draft`` a drafter's name), applied over the server's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..compat import ServeRequestHandling
from ..config import TriForceConfig
from .engine import Job
from .request_models import BadRequest, ChatCompletionBody, TextCompletionBody

TRIFORCE_FIELD = "triforce"


@dataclass
class Parsed:
    """A checked request: its job, whether it streams, whether the last streamed chunk carries the usage."""

    job: Job
    stream: bool
    include_usage: bool


def triforce_from_body(value: Any, base: TriForceConfig | None) -> TriForceConfig | None:
    """The request's TriForce configuration: ``value`` (the body's ``triforce``) over ``base`` (the server's)."""
    if value is None:
        return base
    if value is False:
        return None
    if value is True:
        return base if base is not None else TriForceConfig()
    if not isinstance(value, dict):
        raise BadRequest(f"{TRIFORCE_FIELD} must be false or an object of TriForceConfig fields, got {value!r}")
    known = {f.name for f in fields(TriForceConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise BadRequest(f"{TRIFORCE_FIELD}: unknown TriForceConfig field(s) {unknown}; allowed: {sorted(known)}")
    try:
        return replace(base if base is not None else TriForceConfig(), **value)
    except (TypeError, ValueError) as error:
        raise BadRequest(f"{TRIFORCE_FIELD}: {error}") from error


class RequestParser:
    """Turns request bodies into `Parsed` requests for one served model."""

    def __init__(self, model_id: str, tokenizer, generation_config, context_length: int | None,
                 triforce: TriForceConfig | None) -> None:
        self.model_id, self.tokenizer, self.generation_config = model_id, tokenizer, generation_config
        self.context_length, self.triforce = context_length, triforce
        self.serve = ServeRequestHandling(tokenizer)

    def chat_request(self, body: dict) -> Parsed:
        """A ``/v1/chat/completions`` body."""
        ChatCompletionBody.checked(body, self.model_id)
        extension = triforce_from_body(body.pop(TRIFORCE_FIELD, None), self.triforce)
        try:
            inputs = self.serve.render_chat(body)
        except (KeyError, TypeError) as error:
            raise BadRequest(f"messages: {type(error).__name__}: {error}") from error
        kwargs = self._generation_kwargs("chat", body)
        return self._parsed(body, inputs["input_ids"], kwargs, extension, "messages")

    def completion_request(self, body: dict) -> Parsed:
        """A ``/v1/completions`` body (a text prompt, no chat template)."""
        TextCompletionBody.checked(body, self.model_id)
        extension = triforce_from_body(body.pop(TRIFORCE_FIELD, None), self.triforce)
        ids = self.tokenizer(body["prompt"], return_tensors="pt").input_ids
        kwargs = self._generation_kwargs("text", body)
        return self._parsed(body, ids, kwargs, extension, "prompt")

    def _generation_kwargs(self, endpoint: str, body: dict) -> dict:
        try:
            return self.serve.generation_kwargs(endpoint, body, self.generation_config)
        except (TypeError, ValueError) as error:  # the other fields are checked by the body's model
            raise BadRequest(f"generation_config: {type(error).__name__}: {error}") from error

    def _parsed(self, body: dict, ids, kwargs: dict, triforce: TriForceConfig | None, prompt_field: str) -> Parsed:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        n = ids.shape[1]
        explicit = body.get("max_completion_tokens", body.get("max_tokens"))
        if self.context_length is not None:
            if n >= self.context_length:
                raise BadRequest(f"{prompt_field}: the prompt has {n} tokens; the model takes at most "
                                 f"{self.context_length} positions, prompt and answer")
            room = self.context_length - n
            if explicit is not None and explicit > room:
                name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
                raise BadRequest(f"{name}={explicit}: the prompt has {n} tokens, leaving room for {room} of the "
                                 f"model's {self.context_length} positions")
            kwargs["max_new_tokens"] = min(kwargs["max_new_tokens"], room)
        temperature = body.get("temperature")
        if temperature is not None and temperature > 0:
            kwargs["do_sample"] = True  # as OpenAI: a temperature above 0 samples
        if not kwargs.get("do_sample"):  # greedy: the sampling settings would only draw generate's warnings
            for name in ("temperature", "top_p", "top_k"):
                kwargs.pop(name, None)
        seed = kwargs.pop("seed", None)
        if kwargs.get("stop_strings") is not None and isinstance(kwargs["stop_strings"], str):
            kwargs["stop_strings"] = [kwargs["stop_strings"]]
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        stream_options = body.get("stream_options") or {}
        return Parsed(Job(ids, kwargs, triforce, seed), bool(body.get("stream")),
                      bool(stream_options.get("include_usage")))
