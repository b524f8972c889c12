"""Exact enumeration of a sampled decode: every random choice is replayed from a script, depth first.

`ReplaySampler` implements the library's `Sampler` protocol: each draw takes the scripted option (the first
one past the script) over the draw's support and multiplies the path's probability by that option's
probability; the device-side draws (`device_categorical`, `leading_successes`) read their laws on the host and
are replayed the same way. `enumerate_outcomes` runs a decode once per path of the choice tree and sums each output's
probability: the output law of the library's own code, exactly (up to float rounding), with no sampling noise.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import torch
from transformers import LogitsProcessor, TopKLogitsWarper


class ReplaySampler:
    def __init__(self, script: list[int]) -> None:
        self.script, self.widths, self.probability = script, [], 1.0

    def _choose(self, probs: list[float]) -> int:
        step = len(self.widths)
        choice = self.script[step] if step < len(self.script) else 0
        self.widths.append(len(probs))
        self.probability *= probs[choice]
        return choice

    def bernoulli(self, probability) -> bool:
        p = float(probability)
        if p >= 1.0:
            return True
        if p <= 0.0:
            return False
        return self._choose([p, 1.0 - p]) == 0

    def categorical(self, probs) -> int:
        support = (probs > 0).nonzero()[:, 0].tolist()
        total = float(probs[support].double().sum())
        return support[self._choose([float(probs[i]) / total for i in support])]

    def device_categorical(self, probs) -> torch.Tensor:
        return torch.tensor(self.categorical(probs), device=probs.device)

    def leading_successes(self, probabilities) -> torch.Tensor:
        """The coins tossed one at a time, none past the first False."""
        successes = 0
        for probability in probabilities.tolist():
            if not self.bernoulli(probability):
                break
            successes += 1
        return torch.tensor(successes, device=probabilities.device)


def enumerate_outcomes(run: Callable[[ReplaySampler], Hashable], max_paths: int = 20000) -> tuple[dict, int]:
    """``({output: probability}, paths)`` over every path of the choice tree of ``run``."""
    law: dict = defaultdict(float)
    script: list[int] = []
    for paths in range(1, max_paths + 1):
        sampler = ReplaySampler(script)
        law[run(sampler)] += sampler.probability
        script = script + [0] * (len(sampler.widths) - len(script))
        step = len(sampler.widths) - 1
        while step >= 0 and script[step] + 1 >= sampler.widths[step]:
            step -= 1
        if step < 0:
            return dict(law), paths
        script = script[:step] + [script[step] + 1]
    raise RuntimeError(f"more than {max_paths} paths: shrink the vocabulary, top-k or the number of new tokens")


class FreeThenGreedy(LogitsProcessor):
    """Top-k ``k`` on new tokens ``first`` to ``free - 1`` after a prompt of ``start`` tokens, top-k 1 on the others
    (0: the first new token): the random positions an enumeration visits, the others one token each (the
    enumeration's paths grow exponentially with the random positions)."""

    def __init__(self, start: int, free: int, k: int = 2, first: int = 0) -> None:
        self.start, self.free, self.k, self.first = start, free, k, first

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = self.k if self.first <= input_ids.shape[1] - self.start < self.free else 1
        return TopKLogitsWarper(k)(input_ids, scores)
