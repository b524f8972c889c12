"""Needle in a haystack: Force-2 acceptance with the retrieval cache vs a StreamingLLM cache of equal budget.

A fact is planted at a chosen depth of a long public-domain text; the prompt ends with a question whose
answer needs it. Teacher-forced over the answer tokens, each cache's next-token distribution ``q`` is
compared with the full cache's ``p``: expected acceptance ``sum(min(p, q))`` (sampling, T=1) and greedy
agreement. The StreamingLLM cache keeps the sink chunk and the most recent tokens only.
"""

from __future__ import annotations

import torch

from hf_triforce.caches.buffer import BufferCache
from hf_triforce.caches.retrieval import RetrievalCache
from hf_triforce.forwards.forward import forward_logits, prefill
from hf_triforce.integration import recording_attention
from hf_triforce.kernels.attention import QueryRecorder

NEEDLE = " The secret password of the blue door is {code}. "
QUESTION = (
    "\n\nQuestion: what is the secret password of the blue door?\nAnswer: the secret password of the blue door is"
)
ANSWER = " {code}."


def needle_prompt(tokenizer, haystack: str, context: int, depth: float, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids, answer_ids)``: ``context`` prompt tokens with the needle at ``depth`` (0..1) of the text."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    needle = tokenizer(NEEDLE.format(code=code), add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    room = context - len(needle) - len(question)
    if room < 16:
        raise ValueError(f"context {context} is too short for the needle and the question")
    hay = tokenizer(haystack, add_special_tokens=False).input_ids[:room]
    if len(hay) < room:
        raise ValueError(f"the haystack has {len(hay)} tokens, fewer than the {room} needed")
    cut = int(depth * room)
    ids = hay[:cut] + needle + hay[cut:] + question
    answer = tokenizer(ANSWER.format(code=code), add_special_tokens=False).input_ids
    return torch.tensor([ids]), torch.tensor([answer])


def _agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[float, float]:
    p, q = torch.softmax(p_logits.float(), -1), torch.softmax(q_logits.float(), -1)
    expected = torch.minimum(p, q).sum(-1).mean()
    greedy = (p.argmax(-1) == q.argmax(-1)).float().mean()
    return float(expected), float(greedy)


@torch.no_grad()
def tier_acceptance(model, prompt: torch.Tensor, answer: torch.Tensor, budget: int, chunk_size: int = 8) -> dict:
    """Acceptance of the retrieval and StreamingLLM caches (same budget) against the full cache."""
    layers, n, k = model.config.num_hidden_layers, prompt.shape[1], answer.shape[1]
    forced = torch.cat((prompt[:, -1:], answer[:, :-1]), dim=1)  # predicts each answer token
    full = BufferCache(layers, n + k)
    with recording_attention(model):
        recorder = QueryRecorder()
        prefill(model, prompt[:, :-1], full, chunk_size=2048, recorder=recorder)
        queries = recorder.at(-1)
        p = forward_logits(model, forced, full, n - 1, k)
        caches = {
            "retrieval": RetrievalCache(layers, budget, chunk_size, (budget // 4) // chunk_size * chunk_size, k + 2),
            "streaming": RetrievalCache(layers, budget, chunk_size, budget - chunk_size, k + 2),
        }
        result = {"p_greedy": p.argmax(-1).tolist()}
        for name, cache in caches.items():
            cache.select(full, n - 1, queries)
            expected, greedy = _agreement(p, forward_logits(model, forced, cache, n - 1, k))
            result[f"{name}_acceptance"], result[f"{name}_greedy"] = expected, greedy
    result["answer_found"] = result["p_greedy"] == answer[0].tolist()
    return result
