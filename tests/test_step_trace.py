"""A three-level step reads as the algorithm: tracing one `Decoder._step` (greedy, ``levels=3``, a chain) visits at
most `MOST_MODULES` modules of the package outside `hf_triforce.kernels`. The trace (``sys.setprofile``) sees every
Python frame whose module is ``hf_triforce``'s; the kernels, the compute leaves under the model's own forward (its
attention and linear layers), are listed apart (`KERNELS`)."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.decoding.loop import Decoder

from .conftest import make_model, random_prompt

MOST_MODULES = 14
KERNELS = "hf_triforce.kernels."


def traced_step_modules(model, prompt: torch.Tensor, config: TriForceConfig, step: int = 3) -> set[str]:
    """The ``hf_triforce`` modules whose functions run during the ``step``-th `Decoder._step` of one greedy call."""
    seen: set[str] = set()
    calls = [0]
    original = Decoder._step

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == "hf_triforce" or name.startswith("hf_triforce."):
                seen.add(name)

    def traced(self, active):
        calls[0] += 1
        if calls[0] != step:
            return original(self, active)
        sys.setprofile(profile)
        try:
            return original(self, active)
        finally:
            sys.setprofile(None)

    Decoder._step = traced
    try:
        model.generate(prompt, triforce_config=config, max_new_tokens=24, do_sample=False)
    finally:
        Decoder._step = original
    assert calls[0] >= step, f"the call ran {calls[0]} steps, fewer than the traced one"
    return seen


@pytest.fixture(scope="module")
def three_level_modules():
    config = TriForceConfig(draft="self", levels=3, policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4,
                            window=24, gamma1=2, gamma2=4)
    return traced_step_modules(make_model("llama-gqa"), random_prompt(160), config)


def test_the_trace_sees_the_step(three_level_modules):
    """The trace can fail: it sees the loop, Force 3 and the levels of a three-level step."""
    assert {"hf_triforce.decoding.loop", "hf_triforce.decoding.levels"} <= three_level_modules


def test_a_three_level_step_passes_through_few_modules(three_level_modules):
    algorithm = sorted(name for name in three_level_modules if not name.startswith(KERNELS))
    assert len(algorithm) <= MOST_MODULES, algorithm
