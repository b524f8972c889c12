"""Force 1 drafting two tokens per Force-2 round: the enumerated law is the target's, and a wrong rule is caught.

A Force-2 round drafts ``min(gamma1, still_wanted - 1)`` tokens (`Force2Level.candidate_steps`): with the suite's
``gamma2=2`` (and the policy rotations' ``gamma1=1``) Force 1 never drafts more than one token per round, so a
Force-2 rule that verifies every draft of a round against the *first* draft's laws (Force 2's row ``q[0]`` and
Force 1's ``r[0]`` at every position) gives the target's law there (total variation below 1e-6 in each of their
three-level cases, chains and trees). Here ``gamma1=2, gamma2=3`` and 5 new tokens: the first Force-3 step wants 3
tokens, so its first Force-2 round drafts 2. Each case enumerates the law exactly through the library's own loop
(`tests/enumeration_util.py`), checks it against the target's at the suite's tolerance, proves that Force 2
verified a second draft of a round on some path (recorded at the verifier), and plants that wrong rule
(`first_draft_laws`, at the chain and the tree verifier of Force 2), which must move the law far: chains, Force-1
trees (``tree_nodes``), Force-2 trees (``force2_tree_nodes``), both, and the batch path with int8 drafting tiers,
left padding and a stop token.

Cost: the enumeration grows exponentially with the random positions, so the processors leave two tokens (top-k
2 of a vocabulary of 4) on the first `FREE` new tokens, which hold the round that drafts two, and one token after
(`FreeThenGreedy`): 130 paths per law instead of 1716 with top-k 2 on all 5. With two tokens a tree's sibling (a
point mass: the token the chain did not take) is the whole residual, so the tree cases' laws equal the chains',
under either rule; they run the tree verifier's code and Force 2's tree forwards. The extended tier (``pytest -m
extended``, about a minute each) runs the chains with top-k 2 on all 5 tokens, and Force-1 trees with siblings
drawn without replacement, each carrying its own law (top-k 3 on the round's two drafts).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    StoppingCriteriaList,
)
from transformers.generation.stopping_criteria import EosTokenCriteria

from hf_triforce import TriForceConfig
from hf_triforce.decoding.loop import Decoder
from hf_triforce.drafters.registry import DRAFTERS, DrafterSpec
from hf_triforce.integration import recording_attention
from hf_triforce.verification.draft_tree import DraftTree
from hf_triforce.verification.sampling import acceptance_probability, point_mass, scores_to_probs

from .conftest import make_model, random_prompt
from .enumeration_util import FreeThenGreedy, enumerate_outcomes
from .test_batch import left_padded
from .test_exact_enumeration import CONFIG, TOLERANCE, VOCAB, decoded_law, distance, exercised, target_law
from .test_tree_enumeration import SAMPLED_SIBLINGS, sampled_siblings_drafter

NEW, FREE = 5, 3  # 5 new tokens: the first Force-3 step asks Force 2 for 3 (one first token, room for 4 more)
ROUNDS = dict(gamma1=2, gamma2=3)
# measured total variation under the wrong rule: 0.227 (single row, default and extended chains), 0.155 (sampled
# siblings), 0.049 (the batch's joint law, int8 tiers with per-row scales; 0.114 with one scale per call); under the
# right rule below 1e-6 everywhere
WRONG_RULE_TV = 0.05  # single rows: the planted rule moves the law this far at least
# the batch: its joint law moves less under the int8 tiers' per-row scales (0.049); caught all the same when the
# moved law is >= 1000x the right rule's tolerance (TOLERANCE) away
WRONG_RULE_BATCH_TV = 1000 * TOLERANCE


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    prompt = random_prompt(40, vocab_size=VOCAB, seed=4, period=13)
    return model, prompt


def total_variation(law: dict, exact: dict) -> float:
    return 0.5 * sum(abs(law.get(key, 0.0) - exact.get(key, 0.0)) for key in set(law) | set(exact))


def accept_or_resample(chain, token: int, p: torch.Tensor, q: torch.Tensor | None) -> tuple[bool, int]:
    """``chain``'s speculative acceptance of one proposal ``token ~ q`` against target ``p`` (1-D probabilities)."""
    if q is None:
        q = point_mass(token, p)
    if chain.sampler.bernoulli(acceptance_probability(p[token], q[token])):
        return True, token
    return False, chain.sampler.categorical(chain.resample(p, q))


def first_draft_laws(decoder) -> None:
    """The planted wrong Force-2 rule: every draft of a round verified against the first draft's laws (the
    verifier's row 0 and the first draft's law), the bonus token from its own row. Trees: every node's children
    against the root's row, every drawn node with the law of the root's first child."""
    chain = decoder.force2_verifier

    def verify_chain(proposals, proposal_probs, target_scores):
        q = scores_to_probs(target_scores)
        for i, token in enumerate(proposals):
            accepted, emitted = accept_or_resample(chain, token, q[0], None if proposal_probs is None
                                                   else proposal_probs[0])
            if not accepted:
                return i, emitted
        return len(proposals), chain.sampler.categorical(q[len(proposals)])

    chain.verify = verify_chain
    tree = decoder.force2_tree_verifier
    verify_with = tree.verify

    def verify_tree(draft, target_scores):
        roots = draft.children(-1)
        first = draft.laws[roots[0]] if roots else None
        wrong = DraftTree(draft.tokens, draft.parents, [law if law is None else first for law in draft.laws])
        # a node with children verifies them against the root's row; a leaf's bonus token comes from its own row
        rows = [0 if draft.children(node) else node + 1 for node in range(-1, len(draft))]
        return verify_with(wrong, target_scores[rows])

    tree.verify = verify_tree


def recording(rounds: list, mutate=None, trees: list | None = None):
    """A ``mutate`` for the enumeration harnesses: applies ``mutate``, then records ``(drafted, accepted)`` of
    every Force-2 verification in ``rounds`` (a tree's drafted: its depth; accepted: its accepted path's length)
    and each tree Force 2 verified in ``trees``."""

    def apply(decoder):
        if mutate is not None:
            mutate(decoder)
        chain, tree = decoder.force2_verifier, decoder.force2_tree_verifier
        verify_chain = chain.verify

        def recorded_chain(proposals, proposal_probs, target_scores):
            accepted, token = verify_chain(proposals, proposal_probs, target_scores)
            rounds.append((len(proposals), accepted))
            return accepted, token

        chain.verify = recorded_chain
        verify_tree = tree.verify

        def recorded_tree(draft, target_scores):
            path, token = verify_tree(draft, target_scores)
            rounds.append((max(draft.depths(), default=0), len(path)))
            if trees is not None:
                trees.append(draft)
            return path, token

        tree.verify = recorded_tree

    return apply


def second_drafts_verified(rounds: list) -> None:
    """Some round drafted two tokens and Force 2 verified the second: accepting it on some path, rejecting it on
    another (the rule under test decided both)."""
    accepted = {count for drafted, count in rounds if drafted >= 2}
    assert {1, 2} <= accepted, f"no Force-2 round verified a second draft both ways: {sorted(set(rounds))}"


CASES = {  # name: (drafter, config)
    "chains": ("self", {}),
    "Force-1 trees": ("self", {"tree_nodes": 3, "tree_branch": 2}),
    "Force-2 trees": ("self", {"force2_tree_nodes": 4, "tree_branch": 2}),
    "trees at both levels": ("self", {"tree_nodes": 3, "tree_branch": 2, "force2_tree_nodes": 4}),
    # extended: siblings drawn without replacement, each with its own law (top-k 3 leaves one to draw)
    "Force-1 trees, sampled siblings": (SAMPLED_SIBLINGS, {"tree_nodes": 3, "tree_branch": 2}),
}


def case_laws(setup, case: str, **window):
    """The enumerated law of ``case`` under the right rule and under `first_draft_laws`, the target's, the paths,
    and the recorded rounds and stats of the right rule's paths (``window``: `FreeThenGreedy`'s parameters)."""
    model, prompt = setup
    draft, extra = CASES[case]
    processors = LogitsProcessorList([FreeThenGreedy(prompt.shape[1], **{"free": FREE, **window})])
    rounds, trees = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(DRAFTERS, SAMPLED_SIBLINGS, DrafterSpec(SAMPLED_SIBLINGS, sampled_siblings_drafter, "model", "",
                                                                 trees=True))
        config = TriForceConfig(draft=draft, **{**CONFIG, **ROUNDS, **extra})
        law, paths, stats = decoded_law(model, prompt, config, processors, NEW, recording(rounds, trees=trees))
        wrong, _, _ = decoded_law(model, prompt, config, processors, NEW, first_draft_laws)
    return law, wrong, target_law(model, prompt, processors, NEW), paths, rounds, trees, stats


def check_case(case: str, law: dict, wrong: dict, exact: dict, paths: int, rounds: list, trees: list,
               stats: list) -> None:
    draft, extra = CASES[case]
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert set(law) <= {k for k, p in exact.items() if p > 0}, "a sequence of probability zero was emitted"
    assert distance(law, exact) < TOLERANCE
    if extra.get("force2_tree_nodes"):  # a chain token and its alternative cover top-k 2: never all rejected
        assert any(0 < s.force3_accepted < s.force3_proposed for s in stats)
    else:
        exercised(stats, 3)
    second_drafts_verified(rounds)
    if extra.get("tree_nodes"):
        siblings = any(s.detail.tree_nodes > s.detail.force1_proposed for s in stats)
        assert siblings, "no path verified a Force-1 tree with siblings"
    if draft == SAMPLED_SIBLINGS:  # a drawn sibling carries its law (point masses carry None)
        assert any(tree.laws[node] is not None for tree in trees for node in range(len(tree))
                   if tree.side_nodes([node])), "no Force-1 tree had a drawn sibling"
    if extra.get("force2_tree_nodes"):
        assert any(s.detail.tree_side_accepts for s in stats), "Force 3 never accepted one of Force 2's alternatives"
    gap = total_variation(wrong, exact)
    assert gap > WRONG_RULE_TV, f"{case}: the wrong Force-2 rule moved the law by {gap:.2g} only"


@pytest.mark.parametrize("case", list(CASES)[:4])
def test_second_drafts_of_a_round_are_verified_exactly(setup, case):
    check_case(case, *case_laws(setup, case))


@pytest.mark.extended
@pytest.mark.parametrize("case, window", [("chains", dict(free=NEW)),
                                          ("Force-1 trees, sampled siblings", dict(k=3, first=1))],
                         ids=["chains, top-k 2 on every token", "sampled siblings, top-k 3 on the drafts"])
def test_second_drafts_of_a_round_are_verified_exactly_on_more_paths(setup, case, window):
    """As above with more random positions: top-k 2 on all 5 new tokens; or top-k 3 on the round's two drafts
    with siblings drawn without replacement (the default tier's siblings: point masses)."""
    check_case(case, *case_laws(setup, case, **window))


# The batch path: two left-padded rows, int8 drafting tiers (Force 1 and Force 2 on the int8 copy; a handful of
# rows per call), a stop token. Row 1 (padded) is the one that drafts two per round (top-k 2 on its first `FREE`
# tokens, one token after) and stops at EOS on some paths; row 0 draws its first token from two and then must
# emit EOS: a row that stops first while the other goes on.
EOS = 0


def allowed(row: int, position: int) -> list[int]:
    """Row ``row``'s allowed tokens at new position ``position`` (0: the first new token)."""
    if row == 0:
        return [1, 2] if position == 0 else [EOS]
    return list(range(VOCAB))


def batch_processors(width: int, keyed_by: str) -> LogitsProcessorList:
    """What plain batched ``generate`` runs for ``prefix_allowed_tokens_fn``: the function gets the batch index
    (``"batch index"``) — or here, for a processor that does not depend on it, the row read from its tokens
    (``"row content"``: the row that starts with padding) — and the row's tokens, padding included (``width``:
    the padded prompts' width)."""

    def allowed_tokens(batch_id, sent):
        row = batch_id if keyed_by == "batch index" else int(bool(sent[0] == PAD))
        return allowed(row, sent.shape[0] - width)

    return LogitsProcessorList([PrefixConstrainedLogitsProcessor(allowed_tokens, num_beams=1),
                                FreeThenGreedy(width, FREE)])


def row_target_law(model, prompt, row: int, new: int) -> dict:
    """Row ``row``'s target law alone: its processors with the row fixed, cut at its first EOS."""
    processors = LogitsProcessorList([
        PrefixConstrainedLogitsProcessor(lambda _, sent: allowed(row, sent.shape[0] - prompt.shape[1]), 1),
        FreeThenGreedy(prompt.shape[1], FREE),
    ])
    law: dict = {}
    for tokens, probability in target_law(model, prompt, processors, new).items():
        stop = tokens.index(EOS) + 1 if EOS in tokens else len(tokens)
        law[tokens[:stop]] = law.get(tokens[:stop], 0.0) + probability
    return law


PAD = 3
BATCH_PROMPTS = [(40, 4), (29, 6)]  # (length, seed): row 1 is left-padded by 11


def batch_laws(keyed_by: str, mutate=None):
    """The enumerated joint law of the batch's rows (recording Force 2's rounds) and the product of the rows'
    target laws."""
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    prompts = [random_prompt(length, vocab_size=VOCAB, seed=seed, period=13) for length, seed in BATCH_PROMPTS]
    ids, _ = left_padded(prompts, pad=PAD)
    assert int(ids[0, 0]) != PAD and int(ids[1, 0]) == PAD  # "row content" tells the rows apart
    pads = [ids.shape[1] - p.shape[1] for p in prompts]
    processors = batch_processors(ids.shape[1], keyed_by)
    criteria = StoppingCriteriaList([EosTokenCriteria(EOS)])
    config = TriForceConfig(draft="self", **{**CONFIG, **ROUNDS, "draft_precision": "int8"})
    rounds, stats = [], []
    record = recording(rounds, mutate)

    def run(sampler):
        decoder = Decoder(model, config, processors, criteria, [ids.shape[1] - pad + NEW for pad in pads], True,
                          [ids[r : r + 1, :pad] for r, pad in enumerate(pads)], sampler=sampler)
        record(decoder)
        with torch.no_grad(), recording_attention(model):
            result = decoder.run([p.reshape(1, -1) for p in prompts])
        stats.append(result.row_stats)
        return tuple(tuple(seq[0, p.shape[1]:].tolist()) for seq, p in zip(result.sequences, prompts))

    law, paths = enumerate_outcomes(run)
    marginals = [row_target_law(model, prompt, row, NEW) for row, prompt in enumerate(prompts)]
    exact = {(a, b): pa * pb for a, pa in marginals[0].items() for b, pb in marginals[1].items()}
    return law, exact, paths, rounds, stats


@pytest.mark.parametrize("keyed_by", ["row content", "batch index"])
def test_batch_int8_padded_stopping_rows_verify_second_drafts_exactly(keyed_by):
    """The joint law is the product of the rows' target laws, with each row's processors seeing what plain
    batched ``generate`` shows them (``"batch index"``: the row's index in the batch)."""
    law, exact, paths, rounds, stats = batch_laws(keyed_by)
    assert abs(sum(law.values()) - 1.0) < 1e-6
    assert distance(law, exact) < TOLERANCE, f"{keyed_by}: the joint law is not the product of the rows' laws"
    assert paths > 10
    second_drafts_verified(rounds)
    assert any(0 < s[1].force3_accepted < s[1].force3_proposed for s in stats)
    assert {out[0] for out in law} == {(1, EOS), (2, EOS)}  # row 0 stopped at EOS, row 1 went on
    assert any(len(out[1]) == NEW for out in law) and any(len(out[1]) < NEW for out in law)  # row 1: EOS on some


def test_batch_wrong_force2_rule_is_caught():
    """`first_draft_laws` on the batch path (the rows share Force 2's verifier): the joint law moves far."""
    law, exact, _, rounds, _ = batch_laws("row content", first_draft_laws)
    second_drafts_verified(rounds)
    gap = total_variation(law, exact)
    assert gap > WRONG_RULE_BATCH_TV, f"the wrong Force-2 rule moved the batch's joint law by {gap:.2g} only"
