"""Where greedy identity ends: top-two logits closer than the rounding of a forward.

A verification forward scores several rows at once; its products and attention sum in other orders than a one-row
step's, so its logits differ from plain ``generate``'s by float rounding (1e-7 to 1e-6 of their size in fp32). TriForce
picks each token as the ``argmax`` of the verification's logits, exactly (docs/exactness.md); where the top two
logits of plain decoding are closer than that rounding, the two ``argmax`` may differ. This test builds such a model
(every output row a common vector plus 1e-6 times its own: the logits of all tokens within ~4e-5 of each other,
the top two ~1e-6 apart; the two forwards' logits differ by 3-8e-6) and documents the boundary, on ATen's products
and on the library's kernel alike:

* the outputs part (a float tie is met within 40 tokens), and up to there they are identical;
* at the first difference TriForce's token is the ``argmax`` of its verification's logits, plain ``generate``'s the
  ``argmax`` of its step's, the two forwards' logits differ by float rounding only (within an fp32 dot product's
  bound over the hidden size, relative to their size), and
  the two tokens' logits are within twice that difference of each other: a tie, not a disagreement;
* the same model with output rows 1e-2 apart (logit gaps far above rounding) gives plain ``generate``'s tokens.
"""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.kernels import few_rows_linear, linear_routes

from .conftest import make_model, random_prompt
from .test_cpu_attention import needs_kernel

CONFIG = TriForceConfig(draft="ngram", levels=2, policy="fixed", gamma2=4)
NEW = 40


def near_tie_model(spread: float, seed: int = 4):
    """A tiny Llama whose output rows are one common vector plus ``spread`` times a row of their own."""
    model = make_model("llama-gqa", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    head = model.lm_head.weight
    with torch.no_grad():
        common = torch.randn(head.shape[1], generator=generator)
        head.copy_(common + spread * torch.randn(head.shape, generator=generator))
    return model


def _both(model, prompt):
    plain = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    ours = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, triforce_config=CONFIG)
    return plain, ours


@pytest.mark.parametrize("route", ["linear", pytest.param("stream", marks=needs_kernel)])
def test_greedy_parts_only_at_a_float_tie(monkeypatch, route):
    if route == "stream":
        assert few_rows_linear.status() == "on"
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", lambda self, group, rows: route)
    prompt = random_prompt(150, period=37)
    model = near_tie_model(1e-6)
    plain, ours = _both(model, prompt)
    expected, got = plain.sequences[0, prompt.shape[1]:], ours.sequences[0, prompt.shape[1]:]
    parted = (expected != got).nonzero()
    assert parted.numel(), "no float tie met: the model does not reach the boundary it documents"
    at = int(parted[0])
    step, verified = plain.logits[at][0].double(), ours.logits[at][0].double()
    mine, theirs = int(got[at]), int(expected[at])
    assert verified[mine] == verified.max() and step[theirs] == step.max()
    rounding = (step - verified).abs().max().item()
    # an n-term fp32 dot product's rounding bound, n the hidden size, relative to the logits' size
    assert 0 < rounding <= model.config.hidden_size * 2.0 ** -23 * step.abs().max().item()
    assert step[theirs] - step[mine] <= 2 * rounding and verified[mine] - verified[theirs] <= 2 * rounding
    spread = (step.max() - step.min()).item()
    assert spread < 1e-4  # the whole vocabulary within 1e-4: ties are what this model is made of


def test_the_same_model_with_gaps_above_rounding_is_identical(monkeypatch):
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", lambda self, group, rows: "linear")
    prompt = random_prompt(150, period=37)
    plain, ours = _both(near_tie_model(1e-2), prompt)
    assert torch.equal(plain.sequences, ours.sequences)
