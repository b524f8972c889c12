"""OpenAI response bodies and server-sent events, built with the ``openai`` package's own types, and the usage block
with its TriForce extension (``usage.triforce``: the request's figures; ``usage.prompt_tokens_details.cached_tokens``:
the prompt positions read from the prefix store)."""

from __future__ import annotations

import json
import time
from typing import Any

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails

DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, figures: dict[str, Any]) -> CompletionUsage:
    return CompletionUsage.model_validate({
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": PromptTokensDetails(cached_tokens=figures["prefix_reused_tokens"]),
        "triforce": figures,
    })


def sse(chunk) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def error_event(message: str, kind: str = "server_error") -> str:
    """An error inside a stream (the openai client raises it); no ``[DONE]`` follows it."""
    return f"data: {json.dumps({'error': {'message': message, 'type': kind}})}\n\n"


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class ChatResponses:
    """The bodies and chunks of one ``/v1/chat/completions`` request."""

    def __init__(self, request_id: str, model_id: str) -> None:
        self.request_id, self.model_id, self.created = request_id, model_id, int(time.time())

    def body(self, text: str, finish_reason: str, usage_block: CompletionUsage) -> dict:
        message = ChatCompletionMessage(role="assistant", content=text)
        return ChatCompletion(id=self.request_id, created=self.created, model=self.model_id,
                              object="chat.completion", usage=usage_block,
                              choices=[Choice(index=0, message=message, finish_reason=finish_reason)],
                              ).model_dump(exclude_none=True)

    def chunk(self, text: str | None = None, role: str | None = None, finish_reason: str | None = None,
              usage_block: CompletionUsage | None = None) -> str:
        choices = [] if usage_block is not None else [
            ChunkChoice(index=0, delta=ChoiceDelta(role=role, content=text), finish_reason=finish_reason)]
        return sse(ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model_id,
                                       object="chat.completion.chunk", choices=choices, usage=usage_block))

    def first(self) -> str:
        return self.chunk(role="assistant", text="")


class TextResponses:
    """The bodies and chunks of one ``/v1/completions`` request."""

    def __init__(self, request_id: str, model_id: str) -> None:
        self.request_id, self.model_id, self.created = request_id, model_id, int(time.time())

    def body(self, text: str, finish_reason: str, usage_block: CompletionUsage) -> dict:
        return Completion(id=self.request_id, created=self.created, model=self.model_id, object="text_completion",
                          choices=[CompletionChoice(index=0, text=text, finish_reason=finish_reason)],
                          usage=usage_block).model_dump(exclude_none=True)

    def chunk(self, text: str | None = None, role: str | None = None, finish_reason: str | None = None,
              usage_block: CompletionUsage | None = None) -> str:
        # model_construct: a chunk's finish_reason is None until the last, which the type does not allow
        choices = [] if usage_block is not None else [
            CompletionChoice.model_construct(index=0, text=text or "", logprobs=None, finish_reason=finish_reason)]
        return sse(Completion.model_construct(id=self.request_id, created=self.created, model=self.model_id,
                                              object="text_completion", choices=choices, usage=usage_block))

    def first(self) -> str | None:
        return None
