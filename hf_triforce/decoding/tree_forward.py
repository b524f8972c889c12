"""One forward scoring a candidate tree on a cache, and the processed scores of each of its nodes."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from ..kernels.attention import RECORDER_KWARG, QueryRecorder, recording
from ..kernels.tree_attention import block_visibility, tree_block
from ..verification.draft_tree import DraftTree
from ..verification.scoring import process_each


def tree_logits(model, cache, cached: int, sequence: torch.Tensor, tree: DraftTree,
                recorder: QueryRecorder | None = None) -> torch.Tensor:
    """Raw logits ``[len(tree) + 1, vocab]``: row 0 after ``sequence`` (the root), row ``i + 1`` after node ``i``.

    ``cache`` holds the first ``cached`` tokens of ``sequence`` (at least its last token is not cached: it
    is the root's row). The uncached tail and every node go through one forward; node ``i`` sits at
    position ``len(sequence) - 1 + depth(i)`` and its entries land in the cache after the tail, in node order
    (`BufferCache.keep_rows` keeps the accepted path's afterwards). The recorder, if any, gets the queries of
    the whole block: the tail's rows, then one per node.
    """
    tail = sequence[:, cached:]
    if tail.shape[1] < 1:
        raise ValueError("tree_logits: the sequence's last token must not be cached (it scores the root)")
    nodes = sequence.new_tensor([tree.tokens])
    tokens = torch.cat((tail, nodes), dim=1)
    positions = torch.cat((torch.arange(cached, sequence.shape[1], device=sequence.device)[None],
                           tree.positions(sequence.shape[1], sequence.device)), dim=1)
    visible = block_visibility(tail.shape[1], tree, sequence.device)
    extra = {RECORDER_KWARG: recorder} if recorder is not None else {}
    with tree_block(visible), recording(recorder):
        out = model(input_ids=tokens, cache=cache, position_ids=positions, use_cache=True,
                    logits_to_keep=len(tree) + 1, **extra)
    return out.logits[0, -(len(tree) + 1) :]  # the last rows also where a model ignores logits_to_keep


def process_tree_rows(processors: LogitsProcessorList, sequence: torch.Tensor, tree: DraftTree,
                      logits: torch.Tensor) -> torch.Tensor:
    """Processed fp32 scores of `tree_logits`' rows, each with its own context (``sequence`` + the node's path),
    as ``generate`` would process it decoding that path one token at a time."""

    def context_of(row: int) -> torch.Tensor:
        path = tree.path_tokens(row - 1)
        return torch.cat((sequence, sequence.new_tensor([path])), dim=1) if path else sequence

    return process_each(processors, context_of, logits)


def score_tree(model, cache, cached: int, sequence: torch.Tensor, tree: DraftTree,
               processors: LogitsProcessorList,
               recorder: QueryRecorder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, processed scores)`` of a tree, row 0 the root's (`tree_logits`, `process_tree_rows`)."""
    logits = tree_logits(model, cache, cached, sequence, tree, recorder)
    return logits, process_tree_rows(processors, sequence, tree, logits)
