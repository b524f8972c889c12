"""Reproducibility: the library draws nothing from torch's global RNG but the sampling itself.

* a greedy call leaves the global RNG state untouched, a model's first call included (its drafting copies are made
  and its linear routes timed then);
* under ``policy="fixed"`` a seed reproduces a sampled call, the model's first call included, and the RNG state
  each call leaves is the same.
"""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig

from .conftest import make_model, random_prompt

FIXED = dict(draft="self", policy="fixed", retrieval_budget=32, chunk_size=8, sink_tokens=4, window=16, gamma1=2,
             gamma2=4)


@pytest.mark.parametrize("precision, policy", [("auto", "fixed"), ("model", "fixed"), ("auto", "auto")])
def test_a_greedy_call_leaves_the_global_rng_untouched(precision, policy):
    model = make_model("llama-gqa", seed=21)  # fresh: this is its first call
    torch.manual_seed(5)
    state = torch.get_rng_state()
    config = TriForceConfig(**{**FIXED, "policy": policy}, draft_precision=precision)
    out = model.generate(random_prompt(90, period=23), max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                         triforce_config=config)
    assert out.triforce_stats.detail.linear_calibration_seconds > 0  # the routes were timed in this call
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("precision", ["auto", "model"])
def test_a_seed_reproduces_the_first_sampled_call(precision):
    model = make_model("llama-gqa", seed=22)
    prompt = random_prompt(90, period=23)
    config = TriForceConfig(**FIXED, draft_precision=precision)
    outputs, states = [], []
    for _ in range(3):
        torch.manual_seed(1234)
        outputs.append(model.generate(prompt, max_new_tokens=24, do_sample=True, triforce_config=config))
        states.append(torch.get_rng_state())
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[1], outputs[2])
    assert torch.equal(states[0], states[1]) and torch.equal(states[1], states[2])
