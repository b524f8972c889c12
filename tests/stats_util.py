"""Chi-square goodness of fit without scipy."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed ``counts`` against ``probs``; cells expecting < ``min_expected`` are pooled."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    total = counts.sum()
    expected = probs * total
    big = expected >= min_expected
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))
