"""A drafting `LeanModel` whose output layer scores a subset of the vocabulary (`restricted`; what
``benchmarks/lean_drafting.py --vocab`` measures).

Exact as any draft: the tier hands up the law it drew from, q exactly 0 outside the subset, and the verification's
residual covers those tokens (docs/exactness.md).
"""

from __future__ import annotations

import torch

from hf_triforce.kernels.lean import LeanModel, LeanOutput, Projection

# the logit of tokens outside the subset: exp(-1e4 - x) is exactly 0 in fp32 for any real logit x, and it stays
# finite under temperature, penalties and the other processors
OUTSIDE_LOGIT = -1.0e4


class RestrictedLeanModel(LeanModel):
    """A `LeanModel` view (made by `restricted`) scoring the token ids ``vocabulary`` only: every other token gets
    the logit `OUTSIDE_LOGIT`, so its probability is exactly 0 next to any real logit (and a processor that masks the
    whole subset leaves a uniform law over the rest, not NaN)."""

    vocabulary: torch.Tensor  # [k] increasing token ids: the rows of the output layer it keeps

    def _logits(self, hidden: torch.Tensor, batch: int, n: int, logits_to_keep: int) -> LeanOutput:
        subset = super()._logits(hidden, batch, n, logits_to_keep).logits  # [batch, keep, k]
        logits = subset.new_full((*subset.shape[:-1], self.vocab_size), OUTSIDE_LOGIT)
        logits[..., self.vocabulary] = subset
        return LeanOutput(logits)

    def verifying(self, mode: str) -> LeanModel:
        raise ValueError("Force 3 verifies with the model's own vocabulary; this copy scores a subset of it")


def restricted(model: LeanModel, vocabulary: torch.Tensor) -> RestrictedLeanModel:
    """``model`` with an output layer over the token ids ``vocabulary`` (any shape, repeats allowed) only; the layers,
    norms, rotary and embedding are shared, no compiled view is (a view compiles its own forwards)."""
    vocabulary = torch.unique(vocabulary.reshape(-1).to(torch.long))
    head = model.original.get_output_embeddings()
    bias = None if head.bias is None else head.bias[vocabulary]
    view = RestrictedLeanModel.__new__(RestrictedLeanModel)
    vars(view).update(vars(model), _compiled_views={}, vocabulary=vocabulary,
                      head=Projection(head.weight[vocabulary], bias, model.parts["head"], model.group_size,
                                      weight_left=True))
    return view
