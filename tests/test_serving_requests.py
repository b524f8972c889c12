"""The server's request bodies (`hf_triforce.serving.request_models`, `RequestParser`): the OpenAI fields of
`transformers serve`'s schemas and the server's extensions, a foreign field refused with HTTP 422 naming it, each
value the server cannot honour with HTTP 400 naming the field, a valid body passed on as it came."""

from __future__ import annotations

import re

import pytest
from fastapi import HTTPException
from transformers import GenerationConfig

from hf_triforce import TriForceConfig
from hf_triforce.serving.requests import BadRequest, RequestParser

from .tokenizer_util import word_tokenizer

SERVED = "tiny"
MESSAGES = [{"role": "user", "content": "t5 t6"}]


def _parser(triforce: TriForceConfig | None = None) -> RequestParser:
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}t0 {{ m['content'] }} t1 {% endfor %}" \
                              "{% if add_generation_prompt %}t2{% endif %}"
    return RequestParser(SERVED, tokenizer, GenerationConfig(), 64, triforce)


def _chat(**fields) -> dict:
    return {"model": SERVED, "messages": MESSAGES, "max_tokens": 4, **fields}


def test_the_accepted_fields_are_openais_and_the_servers_extensions():
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat

    from hf_triforce.serving.request_models import ChatCompletionBody, TextCompletionBody

    assert set(ChatCompletionBody.model_fields) == \
           chat.CompletionCreateParamsBase.__mutable_keys__ | {"stream", "generation_config", "chat_template_kwargs",
                                                               "triforce"}
    assert set(TextCompletionBody.model_fields) == \
           text.CompletionCreateParamsBase.__mutable_keys__ | {"stream", "generation_config", "triforce"}


@pytest.mark.parametrize("endpoint,body,named", [
    ("chat", _chat(colour="red"), "colour"),
    ("chat", _chat(colour="red", n=2), "colour"),  # the schema first: a foreign field is a 422 beside a bad value
    ("text", {"prompt": "t5", "max_completion_tokens": 3}, "max_completion_tokens"),  # a chat field only
    ("text", {"prompt": "t5", "messages": MESSAGES}, "messages"),
])
def test_a_foreign_field_is_refused_with_422_naming_it(endpoint, body, named):
    parser = _parser()
    with pytest.raises(HTTPException) as refused:
        (parser.chat_request if endpoint == "chat" else parser.completion_request)(body)
    assert refused.value.status_code == 422
    assert refused.value.detail == f"Unexpected fields in the request: {set([named])}"


BAD_CHAT = [
    ({"model": "other"}, "model 'other' is not served here; this server serves 'tiny'"),
    ({"model": 3}, "model must be the served model's name, got 3"),
    ({"n": 2}, "n must be 1 (one answer per request), got 2"),
    ({"temperature": -0.5}, "temperature must be a number >= 0, got -0.5"),
    ({"temperature": True}, "temperature must be a number >= 0, got True"),
    ({"temperature": "1"}, "temperature must be a number >= 0, got '1'"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0, got nan"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1, got 2.5"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
    ({"max_completion_tokens": 0}, "max_completion_tokens must be an integer >= 1, got 0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"stop": []}, "stop must be a string or a list of non-empty strings, got []"),
    ({"stop": ["t9", ""]}, "stop must be a string or a list of non-empty strings, got ['t9', '']"),
    ({"stop": 3}, "stop must be a string or a list of non-empty strings, got 3"),
    ({"messages": []}, "messages must be a non-empty list of messages, got []"),
    ({"messages": ["t5"]}, "messages must be a non-empty list of messages, got ['t5']"),
    ({"stream": "yes"}, "stream must be a boolean, got 'yes'"),
    ({"stream_options": "usage"}, "stream_options must be an object, got 'usage'"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs must be an object, got [1]"),
    ({"triforce": {"gama1": 2}}, "triforce: unknown TriForceConfig field(s) ['gama1']"),
    ({"triforce": "yes"}, "triforce must be false or an object of TriForceConfig fields, got 'yes'"),
]


@pytest.mark.parametrize("change,message", BAD_CHAT, ids=[message.split()[0] for _, message in BAD_CHAT])
def test_each_bad_chat_value_is_refused_with_400_naming_the_field(change, message):
    with pytest.raises(BadRequest, match=re.escape(message)):
        _parser().chat_request(_chat(**change))


@pytest.mark.parametrize("body,message", [
    ({"model": SERVED}, "messages must be a non-empty list of messages"),
    ([MESSAGES], "the request body must be a JSON object"),
])
def test_a_chat_body_without_messages_is_refused_with_400(body, message):
    with pytest.raises(BadRequest, match=f"^{re.escape(message)}$"):
        _parser().chat_request(body)


@pytest.mark.parametrize("body,message", [
    ({}, "prompt must be a non-empty string"),
    ({"prompt": ""}, "prompt must be a non-empty string, got ''"),
    ({"prompt": ["t5"]}, "prompt must be a non-empty string, got ['t5']"),
    ({"prompt": "t5", "suffix": "t6"}, "suffix must be null (no fill-in-the-middle), got 't6'"),
    ({"prompt": "t5", "top_p": 2}, "top_p must be in (0, 1], got 2"),
    ({"prompt": "t5", "model": "other"}, "model 'other' is not served here"),
])
def test_each_bad_text_value_is_refused_with_400_naming_the_field(body, message):
    with pytest.raises(BadRequest, match=re.escape(message)):
        _parser().completion_request(body)


def test_a_valid_body_is_passed_on_as_it_came():
    """The ``generate`` arguments are transformers serve's mapping of the body itself (ints stay ints, a field the
    server does not read reaches it); the extension is taken out."""
    parser = _parser(TriForceConfig(gamma1=2))
    body = _chat(max_tokens=7, temperature=1, top_p=0.9, seed=3, stop="t9", frequency_penalty=0.5,
                 stream=True, stream_options={"include_usage": True}, user="u", triforce={"gamma1": 3})
    expected = {k: v for k, v in body.items() if k != "triforce"}
    parsed = parser.chat_request(body)
    assert body == expected
    assert parsed.job.ids.tolist() == [[0, 5, 6, 1, 2]]
    assert parsed.job.triforce == TriForceConfig(gamma1=3) and parsed.job.seed == 3
    assert (parsed.stream, parsed.include_usage) == (True, True)
    assert parsed.job.generate_kwargs == {"max_new_tokens": 7, "do_sample": True, "temperature": 1.0,
                                          "top_p": 0.9, "repetition_penalty": 1.5, "stop_strings": ["t9"]}
    text = parser.completion_request({"prompt": "t5 t6", "max_tokens": 2, "n": 1, "triforce": False})
    assert text.job.ids.tolist() == [[5, 6]] and text.job.triforce is None
    assert text.job.generate_kwargs == {"max_new_tokens": 2}  # greedy: no sampling settings
