"""Benchmark prompts: a document continued as is, or a question about it in the model's chat template.

A continuation of a play or an essay by a 135M model quickly falls into a loop, which flatters n-gram drafts;
a question about the document, asked the way an instruct model is used, gives the output users get.
"""

from __future__ import annotations

import torch

QUESTION = ("Summarize what the text above argues or tells, in your own words, in a few paragraphs. "
            "Then name the three ideas you found most surprising and explain why.")
PROMPTS = ("question", "continue")
MARKER = "\u2063DOCUMENT\u2063"


def document_prompt(tokenizer, text: str, context: int, prompt: str = "question") -> torch.Tensor:
    """``[1, context]`` token ids: the start of ``text`` either alone (``"continue"``) or wrapped in the chat
    template as a user message followed by `QUESTION` (``"question"``), truncated so the whole is ``context``."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt must be one of {PROMPTS}, got {prompt!r}")
    document = tokenizer(text, add_special_tokens=False).input_ids
    if prompt == "continue":
        if len(document) < context:
            raise ValueError(f"the text has {len(document)} tokens, fewer than the context {context}")
        return torch.tensor([document[:context]])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("prompt='question' needs a tokenizer with a chat template; use prompt='continue'")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": f"{MARKER}\n\n{QUESTION}"}],
                                             tokenize=False, add_generation_prompt=True)
    head, tail = rendered.split(MARKER)
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    tail_ids = tokenizer(tail, add_special_tokens=False).input_ids
    room = context - len(head_ids) - len(tail_ids)
    if room < 16 or len(document) < room:
        raise ValueError(f"context {context} does not fit the question prompt around {len(document)} text tokens")
    return torch.tensor([head_ids + document[:room] + tail_ids])
