"""The exact speculative acceptance math, shared by both verification levels.

Contract: a proposal ``x ~ q`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection a token is
drawn from the residual ``norm(max(p - q, 0))``. The emitted token is then distributed exactly as ``p``.
A ``q`` of ``None`` means a point mass on the proposed token (a deterministic drafter such as n-gram lookup).
Greedy verification accepts while the proposal equals ``argmax p`` and emits ``argmax p`` otherwise.

Every random draw goes through a `Sampler` (two discrete choices: a biased coin and a categorical draw), so
that one decode call's randomness is one object: `TorchSampler` uses torch's global RNG as ``generate``
does; a test can substitute a sampler that enumerates every outcome with its probability. The draws of a decoding
step stay on the device (`Sampler.device_categorical`, `Sampler.leading_successes`) until the verification's one
readback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .scoring import check_nan, read_back


class Sampler(Protocol):
    def bernoulli(self, probability: float | torch.Tensor) -> bool:
        """True with ``probability`` (in [0, 1]: a float read back to the host, or a 0-d tensor)."""

    def categorical(self, probs: torch.Tensor) -> int:
        """One index drawn from the 1-D distribution ``probs``."""

    def device_categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """`categorical` left on the device: a 0-d long tensor on ``probs``' device (``probs``: ``[vocab]``)."""

    def leading_successes(self, probabilities: torch.Tensor) -> torch.Tensor:
        """Of independent coins, coin ``i`` True with ``probabilities[i]`` (``[n]``, in [0, 1]), how many come up True
        before the first False (``n`` if none does): a 0-d long tensor on ``probabilities``' device. A sampler that
        tosses the coins one at a time tosses none past the first False (they do not change the count's law)."""


class TorchSampler:
    """Draws from torch's global RNG (seeded by ``torch.manual_seed``, like ``generate``), on the device of what it
    draws from: a categorical draw is ``torch.multinomial``'s; the coins of `leading_successes` are ``n`` uniforms
    drawn at once (``torch.rand``, the same values as ``n`` coins drawn one by one)."""

    def bernoulli(self, probability: float | torch.Tensor) -> bool:
        device = probability.device if isinstance(probability, torch.Tensor) else None
        return bool(torch.rand((), device=device) < probability)

    def categorical(self, probs: torch.Tensor) -> int:
        return int(self.device_categorical(probs))

    def device_categorical(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, num_samples=1)[0]

    def leading_successes(self, probabilities: torch.Tensor) -> torch.Tensor:
        coins = torch.rand(probabilities.shape, device=probabilities.device) < probabilities
        return coins.long().cumprod(0).sum()


def scores_to_probs(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores in fp32; raises on NaN so garbage is never sampled. Within
    `scoring.deferred_nan_checks` the check is read with the next readback, which raises before anything drawn
    from these probabilities is emitted; a NaN row is uniform meanwhile, so that a draw from it does not fail
    first (on CUDA a draw from NaN probabilities is a device-side assert)."""
    probs = torch.softmax(scores.float(), dim=-1)
    flag = check_nan(probs)
    return probs if flag is None else torch.where(flag, torch.full_like(probs, 1.0 / probs.shape[-1]), probs)


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


Resample = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ChainVerifier:
    """Verifies a chain of proposals against a target, at one level of the hierarchy.

    ``resample(p, q)`` is the law drawn from after a rejection: the residual (exact). It is a field so that
    tests can substitute a wrong rule and show that the distribution tests catch it.
    """

    do_sample: bool
    sampler: Sampler
    resample: Resample = residual_distribution
    # (proposals, the values of the accepted ones) of the last readback of proposals
    read: tuple | None = field(default=None, repr=False, compare=False)

    def verify(self, proposals: list[int] | torch.Tensor, proposal_probs: torch.Tensor | None,
               target_scores: torch.Tensor) -> tuple[int, int]:
        """Verify ``proposals`` against the processed target scores of ``len(proposals) + 1`` positions.

        Returns ``(n_accepted, next_token)``: the first ``n_accepted`` proposals stand, followed by
        ``next_token`` (a residual resample at the first rejection, or a bonus token from the last position).
        ``proposal_probs[i]`` is the distribution proposal ``i`` was drawn from (``None``: point masses).
        ``proposals``: token ids, or a ``[n]`` tensor on the scores' device (a drafter's greedy tokens, compared
        there; `emitted` then has their values). The host reads one transfer (`scoring.read_back`: greedy, the
        argmax at every position and how many agree; sampling, the proposals, how many the sampler's coins accepted and
        the token drawn after them, every draw made on the device).
        """
        n = len(proposals)
        if target_scores.shape[0] != n + 1:
            raise ValueError(f"verify needs {n + 1} rows of target scores, got {target_scores.shape[0]}")
        if not self.do_sample:
            best = target_scores.argmax(-1)
            if isinstance(proposals, torch.Tensor):
                agree = (proposals.to(best.device) == best[:n]).long().cumprod(0).sum()
                *tokens, accepted = read_back(torch.cat((best, agree[None])))
                self.read = (proposals, tokens[:accepted])  # the accepted proposals are the argmax there
                return accepted, tokens[accepted]
            tokens = read_back(best)
            accepted = next((i for i, token in enumerate(proposals) if tokens[i] != token), n)
            return accepted, tokens[accepted]
        p = scores_to_probs(target_scores)
        chosen = proposals.to(p.device) if isinstance(proposals, torch.Tensor) else \
            torch.tensor(list(proposals), dtype=torch.long, device=p.device)
        positions = torch.arange(n, device=p.device)
        q_chosen = torch.ones(n, device=p.device) if proposal_probs is None else proposal_probs[positions, chosen]
        accepted = self.sampler.leading_successes(acceptance_probability(p[positions, chosen], q_chosen))
        # the law of the token after the accepted ones: the residual at the first rejection, p after the last
        at = accepted.reshape(1)
        law = p.index_select(0, at)[0]
        if n:
            last = at.clamp(max=n - 1)  # the rejected proposal's position (where none was rejected: unused)
            q = torch.zeros_like(law).index_fill_(0, chosen.index_select(0, last), 1.0) if proposal_probs is None \
                else proposal_probs.index_select(0, last.to(proposal_probs.device))[0].to(p.device)
            law = torch.where(accepted < n, self.resample(law, q), law)
        next_token = self.sampler.device_categorical(law)
        *tokens, accepted, next_token = read_back(torch.cat((chosen, at, next_token.reshape(1).to(p.device))))
        self.read = (proposals, tokens[:accepted])
        return accepted, next_token

    def emitted(self, proposals: list[int] | torch.Tensor, accepted: int, next_token: int) -> list[int]:
        """The tokens a `verify` emitted, on the host: the first ``accepted`` proposals, then ``next_token``
        (proposals on the device: as its readback had them, else read now)."""
        if not isinstance(proposals, torch.Tensor):
            return list(proposals[:accepted]) + [next_token]
        if self.read is not None and self.read[0] is proposals and len(self.read[1]) >= accepted:
            return self.read[1][:accepted] + [next_token]
        return proposals[:accepted].tolist() + [next_token]


def verify_chain(proposals: list[int], proposal_probs: torch.Tensor | None, target_scores: torch.Tensor,
                 do_sample: bool) -> tuple[int, int]:
    """`ChainVerifier.verify` with the residual rule and torch's global RNG."""
    return ChainVerifier(do_sample, TorchSampler()).verify(proposals, proposal_probs, target_scores)
