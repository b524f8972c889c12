"""The OpenAI request bodies the server takes, typed: `ChatCompletionBody` (``/v1/chat/completions``) and
`TextCompletionBody` (``/v1/completions``).

The accepted fields are those of `transformers serve`'s request schemas (the ``openai`` package's
``CompletionCreateParams`` of each endpoint, with ``generation_config``, ``seed``, ``chat_template_kwargs`` on chat,
``stream`` on text) and the ``triforce`` extension. The fields the server reads are typed and constrained; the
others are accepted as they come and passed on (to the chat template, to ``generate``) or unused, as there.
`checked` refuses a field outside the schema with HTTP 422 (fastapi's ``HTTPException``, the message of
`transformers serve`), and a value the server cannot honour with `BadRequest` (HTTP 400) naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator

NonEmptyText = Annotated[str, Field(min_length=1)]


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400); the message names the field."""


class _Body(BaseModel):
    """The fields both endpoints share and check. The ``description`` of a constrained field completes its refusal,
    ``"<field> must be <description>, got <value>"``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model's name")
    n: Literal[1] | None = Field(None, description="1 (one answer per request)")
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description="a number >= 0")
    top_p: float | None = Field(None, gt=0, le=1, description="in (0, 1]")
    max_tokens: int | None = Field(None, ge=1, description="an integer >= 1")
    seed: int | None = Field(None, ge=0, description="an integer >= 0")
    stop: str | Annotated[list[NonEmptyText], Field(min_length=1)] | None = Field(
        None, description="a string or a list of non-empty strings")
    stream: bool | None = Field(None, description="a boolean")
    stream_options: dict[str, Any] | None = Field(None, description="an object")
    triforce: Any = None  # `hf_triforce.serving.requests.triforce_from_body` reads it over the server's configuration

    @field_validator("model")
    @classmethod
    def _served(cls, model: str | None, info: ValidationInfo) -> str | None:
        served = info.context["served"]
        if model is not None and model != served:
            raise ValueError(f"model {model!r} is not served here; this server serves {served!r}")
        return model

    @classmethod
    def checked(cls, body: Any, served: str):
        """``body`` (the request's JSON) validated, ``served`` the model name it may give; raises ``HTTPException``
        (422) naming each field outside the schema, else `BadRequest` for the first field refused."""
        try:
            return cls.model_validate(body, context={"served": served})
        except ValidationError as error:
            raise cls._refusal(error.errors(), body) from error

    @classmethod
    def _refusal(cls, problems: list[dict], body: Any) -> Exception:
        unexpected = {problem["loc"][0] for problem in problems if problem["type"] == "extra_forbidden"}
        if unexpected:
            return HTTPException(status_code=422, detail=f"Unexpected fields in the request: {unexpected}")
        problem = problems[0]
        if not problem["loc"]:
            return BadRequest("the request body must be a JSON object")
        name = problem["loc"][0]
        if problem["type"] == "value_error":
            return BadRequest(str(problem["ctx"]["error"]))
        refusal = f"{name} must be {cls.model_fields[name].description}"
        return BadRequest(refusal if problem["type"] == "missing" else f"{refusal}, got {body[name]!r}")


class _Chat(_Body):
    """A chat completion body's fields beyond those both endpoints share."""

    messages: list[dict[str, Any]] = Field(min_length=1, description="a non-empty list of messages")
    max_completion_tokens: int | None = Field(None, ge=1, description="an integer >= 1")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="an object")


class _Text(_Body):
    """A text completion body's fields beyond those both endpoints share."""

    prompt: NonEmptyText = Field(description="a non-empty string")
    suffix: None = Field(None, description="null (no fill-in-the-middle)")


def _passed_on(name: str, base: type[_Body], doc: str, fields: str):
    """``base`` with ``fields`` (space-separated names) accepted as they come."""
    return create_model(name, __base__=base, __doc__=doc, __module__=__name__,
                        **{field: (Any, None) for field in fields.split()})


ChatCompletionBody = _passed_on(
    "ChatCompletionBody", _Chat, "A ``/v1/chat/completions`` body.",
    "audio frequency_penalty function_call functions generation_config logit_bias logprobs metadata modalities "
    "moderation parallel_tool_calls prediction presence_penalty prompt_cache_key prompt_cache_options "
    "prompt_cache_retention reasoning_effort response_format safety_identifier service_tier store tool_choice tools "
    "top_logprobs user verbosity web_search_options")
TextCompletionBody = _passed_on(
    "TextCompletionBody", _Text, "A ``/v1/completions`` body.",
    "best_of echo frequency_penalty generation_config logit_bias logprobs presence_penalty user")
