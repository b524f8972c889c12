"""The acceptance math: exact enumeration of one hierarchical step, and the real sampler by Monte Carlo."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_triforce.verification.sampling import (
    ChainVerifier,
    TorchSampler,
    acceptance_probability,
    residual_distribution,
    scores_to_probs,
    verify_chain,
)

from .stats_util import chi_square_pvalue


def emitted(incoming: torch.Tensor, target: torch.Tensor, proposal: torch.Tensor, resample=residual_distribution):
    """Exact law of the token emitted when a token drawn from ``incoming`` is verified as if drawn from
    ``proposal`` against ``target``: accepted with min(1, target/proposal), else drawn from ``resample``."""
    accept = acceptance_probability(target, proposal)
    rejected_mass = (incoming * (1 - accept)).sum()
    return incoming * accept + rejected_mass * resample(target, proposal)


def random_simplex(generator: torch.Generator, vocab: int, sharpness: float) -> torch.Tensor:
    logits = torch.randn(vocab, generator=generator, dtype=torch.float64) * sharpness
    if vocab > 3:
        logits[torch.randint(0, vocab, (1,), generator=generator)] = -float("inf")  # some zero-probability tokens
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("seed", range(20))
def test_hierarchical_step_is_exact_and_q_resampling_is_caught(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 2 + seed % 7
    p, q, r = (random_simplex(g, vocab, 2.0) for _ in range(3))
    force2 = emitted(r, q, r)  # Force 1 draws from r, Force 2 verifies against q
    assert torch.allclose(force2, q, atol=1e-6)
    force3 = emitted(force2, p, q)  # Force 2's token, verified by Force 3 against p
    assert torch.allclose(force3, p, atol=1e-6)

    # The reference implementation's middle level resamples from q itself instead of the residual.
    wrong2 = emitted(r, q, r, resample=lambda target, proposal: target)
    wrong3 = emitted(wrong2, p, q)
    if not torch.allclose(q, r, atol=1e-3):
        assert (wrong3 - p).abs().max() > 1e-6, "the enumeration must tell the wrong rule apart"


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(2, 12),
    sharpness=st.floats(0.1, 6.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_hierarchical_step_is_exact(vocab, sharpness, seed):
    g = torch.Generator().manual_seed(seed)
    p, q, r = (random_simplex(g, vocab, sharpness) for _ in range(3))
    assert torch.allclose(emitted(emitted(r, q, r), p, q), p, atol=1e-6)


def test_wrong_rule_total_variation_is_large_somewhere():
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(200):
        p, q, r = (random_simplex(g, 4, 3.0) for _ in range(3))
        wrong3 = emitted(emitted(r, q, r, resample=lambda t, s: t), p, q)
        worst = max(worst, 0.5 * float((wrong3 - p).abs().sum()))
    assert worst > 0.1


def test_verify_chain_monte_carlo_matches_target():
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(3)
    vocab = 6
    p, q = random_simplex(g, vocab, 1.5).float(), random_simplex(g, vocab, 1.5).float()
    target_scores = torch.log(torch.stack((p, p)))
    counts = torch.zeros(vocab)
    for _ in range(20000):
        token = int(torch.multinomial(q, 1))
        accepted, nxt = verify_chain([token], q[None], target_scores, do_sample=True)
        counts[token if accepted else nxt] += 1
    assert chi_square_pvalue(counts, p) > 1e-3


def test_point_mass_proposals_keep_the_target_law():
    torch.manual_seed(11)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    counts = torch.zeros(4)
    for _ in range(20000):
        accepted, nxt = verify_chain([1], None, torch.log(torch.stack((p, p))), do_sample=True)
        counts[1 if accepted else nxt] += 1
    assert counts[3] == 0
    assert chi_square_pvalue(counts[:3], p[:3]) > 1e-3


class CountsEverySuccess(TorchSampler):
    """A planted wrong `leading_successes`: every True coin counted, not only those before the first False."""

    def leading_successes(self, probabilities: torch.Tensor) -> torch.Tensor:
        return (torch.rand(probabilities.shape) < probabilities).long().sum()


def emitted_pairs(sampler, runs: int = 6000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three point-mass proposals verified ``runs`` times with ``sampler``'s device-side draws: ``p`` (the four
    target rows), the counts of the first emitted token, and of the second where the first is the first proposal."""
    g = torch.Generator().manual_seed(9)
    vocab = 5
    p = torch.stack([random_simplex(g, vocab, 1.0) for _ in range(4)]).float()
    proposals = p[:3].argmax(-1).tolist()  # each row's likeliest token: accepted often, rejected often enough
    verifier = ChainVerifier(True, sampler)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(runs):
        accepted, token = verifier.verify(proposals, None, torch.log(p))
        emitted = verifier.emitted(proposals, accepted, token)
        first[emitted[0]] += 1
        if emitted[0] == proposals[0]:
            second[emitted[1]] += 1
    return p, first, second


def test_device_draws_keep_the_target_law_along_a_chain():
    """`TorchSampler`'s device-side draws (the coins at once, `leading_successes`; the token after them,
    `device_categorical`) give a chain's emitted tokens the target's law, row after row; a sampler counting every
    successful coin (not only those before the first rejection) is caught."""
    torch.manual_seed(13)
    p, first, second = emitted_pairs(TorchSampler())
    assert chi_square_pvalue(first, p[0]) > 1e-3 and chi_square_pvalue(second, p[1]) > 1e-3
    torch.manual_seed(13)
    p, first, _ = emitted_pairs(CountsEverySuccess())
    assert chi_square_pvalue(first, p[0]) < 1e-6


def test_greedy_chain():
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert verify_chain([1, 0], None, scores, do_sample=False) == (2, 2)
    assert verify_chain([1, 2], None, scores, do_sample=False) == (1, 0)
    assert verify_chain([], None, scores[:1], do_sample=False) == (0, 1)


def test_nan_scores_raise():
    with pytest.raises(FloatingPointError, match="NaN"):
        scores_to_probs(torch.tensor([[float("nan"), 0.0]]))


def test_minus_inf_logits_are_fine():
    probs = scores_to_probs(torch.tensor([[-float("inf"), 0.0, 1.0]]))
    assert probs[0, 0] == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
