"""The drafter registry: every drafter is one file, read by the config, the CLI and the bench."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.drafters import DRAFTERS, DraftContext, Drafter, build_drafter, drafter_names, register_drafter
from hf_triforce.drafters.ngram import NgramDrafter
from hf_triforce.drafters.suffix import SuffixDrafter
from hf_triforce_bench.methods import METHODS

from .conftest import make_model, random_prompt


def test_registry_lists_every_drafter_module():
    assert {"self", "ngram", "suffix", "model"} <= set(DRAFTERS)
    assert "model" not in drafter_names()  # a draft model is passed as an object, not by name
    assert {"triforce-suffix", "triforce-suffix-int8"} <= set(METHODS)
    with pytest.raises(ValueError, match="already registered"):
        register_drafter("ngram", lambda context: None, "lookup", "twice")
    with pytest.raises(ValueError, match="kind must be"):
        register_drafter("other", lambda context: None, "oracle", "?")


def test_suffix_drafter_follows_the_most_frequent_continuation():
    seq = torch.tensor([[5, 1, 2, 5, 1, 3, 5, 1, 2, 9, 5, 1]])
    # "5 1" continued by 2 twice and by 3 once: the suffix drafter says 2, then what followed "5 1 2"
    assert SuffixDrafter(2, 1).propose(seq, 3)[0] == [2, 5, 1]
    assert NgramDrafter(2, 1).propose(seq, 3)[0] == [2, 9, 5]  # the most recent occurrence instead
    assert SuffixDrafter(3, 3).propose(torch.tensor([[1, 2, 3, 4]]), 2) == ([], None)


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_suffix_drafter_is_greedy_identical(policy):
    model = make_model("qwen2")
    prompt = random_prompt(150, period=31)
    config = TriForceConfig(draft="suffix", retrieval_budget=48, chunk_size=8, sink_tokens=4, window=24,
                            gamma1=3, gamma2=6, policy=policy)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    if policy == "fixed":
        assert out.triforce_stats.force2_accepted > 0


def test_a_new_drafter_is_one_registration():
    """A drafter registered from outside (what one new file does) is usable by name at once; `Drafter`'s defaults
    (no forwards to batch, the device sequence, chains only) serve it."""

    class RepeatLast(Drafter):
        def prefill(self, prompt):
            pass

        def propose(self, sequence, n):
            return [int(sequence[0, -1])] * n, None

        def rollback(self, length):
            pass

        def nbytes(self):
            return 0

    register_drafter("repeat-last", lambda context: RepeatLast(), "lookup", "repeats the last token")
    try:
        model = make_model("llama-gqa")
        prompt = random_prompt(120, period=23)
        config = TriForceConfig(draft="repeat-last", retrieval_budget=48, chunk_size=8, sink_tokens=4, window=24,
                                policy="fixed")
        expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False, triforce_config=config),
                           expected)
        with pytest.raises(ValueError, match="the 'repeat-last' drafter proposes chains only"):  # trees=False
            TriForceConfig(draft="repeat-last", tree_nodes=4, tree_branch=2)
    finally:
        DRAFTERS.pop("repeat-last")


def test_a_drafter_must_subclass_drafter():
    """A build that returns something other than a `Drafter` is refused when the drafter is built, naming it."""

    class Plain:
        def propose(self, sequence, n):
            return [], None

    register_drafter("plain", lambda context: Plain(), "lookup", "not a Drafter")
    try:
        context = DraftContext(None, TriForceConfig(draft="plain"), None, False, None)
        with pytest.raises(TypeError, match="the 'plain' drafter's build returned a Plain, which does not subclass"):
            build_drafter(context)
    finally:
        DRAFTERS.pop("plain")


def test_drafter_required_methods_and_defaults():
    """`Drafter`'s required methods name the class that lacks them; its optional ones have their documented
    defaults: `propose_steps` runs no forward and returns `propose`'s answer, `propose_tree` refuses."""

    class Bare(Drafter):
        def propose(self, sequence, n):
            return [7] * n, None

    bare = Bare()
    for call in (lambda: bare.prefill(torch.zeros(1, 1)), lambda: bare.rollback(0), bare.nbytes,
                 lambda: Drafter().propose(torch.zeros(1, 1), 1)):
        with pytest.raises(NotImplementedError, match="must implement Drafter"):
            call()
    steps = bare.propose_steps(torch.zeros(1, 1), 2)
    with pytest.raises(StopIteration) as stop:
        next(steps)
    assert stop.value.value == ([7, 7], None)
    assert bare.host_sequence is False and bare.seconds == 0.0
    with pytest.raises(NotImplementedError, match="Bare proposes chains only"):
        bare.propose_tree(torch.zeros(1, 1), 2, 4, 2)
