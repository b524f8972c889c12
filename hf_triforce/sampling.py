"""The exact speculative acceptance math, shared by both verification levels.

Contract: a proposal ``x ~ q`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection a token is
drawn from the residual ``norm(max(p - q, 0))``. The emitted token is then distributed exactly as ``p``.
A ``q`` of ``None`` means a point mass on the proposed token (a deterministic drafter such as n-gram lookup).
Greedy verification accepts while the proposal equals ``argmax p`` and emits ``argmax p`` otherwise.
"""

from __future__ import annotations

import torch


def scores_to_probs(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores in fp32; raises on NaN so garbage is never sampled."""
    probs = torch.softmax(scores.float(), dim=-1)
    if torch.isnan(probs).any():
        raise FloatingPointError(
            "NaN in the probabilities of a TriForce tier: the model produced NaN/inf logits "
            "(try float32 or bfloat16 instead of float16)"
        )
    return probs


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``min(1, p / q)`` elementwise (1 where ``q`` is 0: such a token is never proposed)."""
    return torch.where(q > 0, torch.clamp(p / q.clamp_min(torch.finfo(q.dtype).tiny), max=1.0), torch.ones_like(p))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))``; falls back to ``p`` when the residual has no mass (then ``p == q``)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    """The distribution of a deterministic proposal."""
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def sample(probs: torch.Tensor) -> int:
    """One token from ``probs`` (uses torch's global RNG, as ``generate`` does)."""
    return int(torch.multinomial(probs, num_samples=1))


def accept_or_resample(token: int, p: torch.Tensor, q: torch.Tensor | None) -> tuple[bool, int]:
    """Speculative acceptance of one proposal ``token ~ q`` against target ``p`` (1-D probabilities)."""
    if q is None:
        q = point_mass(token, p)
    if torch.rand((), device=p.device) < acceptance_probability(p[token], q[token]):
        return True, token
    return False, sample(residual_distribution(p, q))


def verify_chain(
    proposals: list[int],
    proposal_probs: torch.Tensor | None,
    target_scores: torch.Tensor,
    do_sample: bool,
) -> tuple[int, int]:
    """Verify a chain of proposals against ``len(proposals) + 1`` rows of target scores.

    Returns ``(n_accepted, next_token)``: the first ``n_accepted`` proposals stand, followed by
    ``next_token`` (a residual resample at the first rejection, or a bonus token from the last row).
    """
    n = len(proposals)
    if target_scores.shape[0] != n + 1:
        raise ValueError(f"verify_chain needs {n + 1} rows of target scores, got {target_scores.shape[0]}")
    if not do_sample:
        best = target_scores.argmax(-1).tolist()
        for i, token in enumerate(proposals):
            if best[i] != token:
                return i, best[i]
        return n, best[n]
    p = scores_to_probs(target_scores)
    for i, token in enumerate(proposals):
        accepted, emitted = accept_or_resample(token, p[i], None if proposal_probs is None else proposal_probs[i])
        if not accepted:
            return i, emitted
    return n, sample(p[n])
