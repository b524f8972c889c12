"""`PrefixStore` and `Engine` in one process: reused prefixes give the answers fresh prompts give (greedy), stored
caches are never written, the byte budget evicts whole entries least recently used first, the longest shared prefix
wins; and the ``serve`` command's options are checked before anything starts."""

import pytest
import torch
from transformers import DynamicCache

from hf_triforce import TriForceConfig
from hf_triforce.serving import Engine, Job, PrefixStore, prefix_view
from hf_triforce.serving.prefix_store import cache_nbytes
from hf_triforce.tools.cli import main

from .conftest import make_model, random_prompt
from .tokenizer_util import word_tokenizer

CONFIG = TriForceConfig(retrieval_budget=64, chunk_size=8, window=32)


@pytest.fixture(scope="module")
def sharp_model():
    return make_model("llama-gqa", logit_scale=4.0)


class RecordingStore(PrefixStore):
    """A `PrefixStore` that keeps a copy of each entry as it is stored (and where its tensors live)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.copies = {}

    def put(self, tokens, cache) -> bool:
        kept = super().put(tokens, cache)
        if kept:
            self.copies[next(reversed(self._entries))] = [
                (layer.keys.data_ptr(), layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        return kept

    def unwritten(self) -> bool:
        """Whether every stored entry is still in the tensors it was stored in, bit for bit as it was stored."""
        return all(all(p == layer.keys.data_ptr() and torch.equal(k, layer.keys) and torch.equal(v, layer.values)
                       for (p, k, v), layer in zip(self.copies[key], entry.cache.layers))
                   for key, entry in self._entries.items())


def test_reused_prefix_answers_equal_fresh_ones_and_leave_the_store_unwritten(sharp_model):
    """Questions sharing a document: the later ones reuse the first's prefix (a view of its first positions) and
    answer as a fresh prompt does, with TriForce and with plain decoding; every stored cache, read through views
    and by ``generate(cache=...)``, stays bit-identical to what was stored."""
    document = random_prompt(300, period=23)
    questions = [torch.cat([document, random_prompt(9, seed=s)], dim=1) for s in (5, 6, 7)]
    store = RecordingStore(1 << 30, 16, sharp_model.config)
    engine = Engine(sharp_model, word_tokenizer(), store, prefill_chunk_size=128)
    for index, ids in enumerate(questions):
        for triforce in (CONFIG, None):
            answer = engine.run(Job(ids, {"max_new_tokens": 32, "do_sample": False}, triforce))
            fresh = sharp_model.generate(ids, max_new_tokens=32, do_sample=False, triforce_config=triforce)
            assert answer.tokens == fresh[0, ids.shape[1]:].tolist()
            assert answer.figures["prefix_reused_tokens"] == (0 if index == 0 and triforce is CONFIG else
                                                              300 if triforce is CONFIG else ids.shape[1] - 1)
            assert store.unwritten()
    assert answer.figures["enabled"] is False
    assert store.describe()["positions"] == [ids.shape[1] - 1 for ids in questions]


def test_a_view_extended_leaves_its_entry_alone(sharp_model):
    ids = random_prompt(64)
    cache = DynamicCache(config=sharp_model.config)
    with torch.no_grad():
        sharp_model(ids, cache=cache)
    before = [layer.keys.clone() for layer in cache.layers]
    view = prefix_view(cache, 40, sharp_model.config)
    assert view.get_seq_length() == 40
    with torch.no_grad():
        sharp_model(random_prompt(8, seed=3), cache=view)
    assert view.get_seq_length() == 48 and cache.get_seq_length() == 64
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, cache.layers))


def _filled(model, tokens: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens[None], cache=cache)
    return cache


def test_longest_prefix_wins_and_the_budget_evicts_least_recently_used(sharp_model):
    a, b, c = (random_prompt(40, seed=s)[0] for s in (1, 2, 3))
    one = cache_nbytes(_filled(sharp_model, a))
    store = PrefixStore(2 * one, 8, sharp_model.config)
    assert store.put(a, _filled(sharp_model, a)) and store.put(b, _filled(sharp_model, b))
    view, length = store.lookup(torch.cat([a[:30], b[:5]]))
    assert length == 30 and view.get_seq_length() == 30
    assert store.lookup(torch.cat([a[:5], b]))[0] is None  # shares 5 tokens, under min_tokens
    store.lookup(a)  # a is now the most recently used: c evicts b
    assert store.put(c, _filled(sharp_model, c))
    assert store.describe()["entries"] == 2 and store.nbytes <= store.max_bytes
    assert store.lookup(b)[1] == 0 and store.lookup(a)[1] == 40 and store.lookup(c)[1] == 40
    longer = torch.cat([a, b[:8]])  # extends a: replaces it; c goes too (40 + 48 positions exceed the budget's 80)
    assert store.put(longer, _filled(sharp_model, longer))
    assert store.describe()["positions"] == [48] and store.lookup(c)[1] == 0
    assert not store.put(a[:20], _filled(sharp_model, a[:20]))  # already held
    assert not PrefixStore(one - 1, 8, sharp_model.config).put(a, _filled(sharp_model, a))  # over the whole budget


def test_sliding_window_models_are_named_unsupported():
    model = make_model("mistral", sliding_window=16)
    assert "sliding-window" in PrefixStore.supports(model.config)
    assert PrefixStore.supports(make_model("llama-gqa").config) is None


@pytest.mark.parametrize("argv,named", [
    (["serve", "smollm2-135m", "--triforce-config", '{"gamma9": 1}'], "gamma9"),
    (["serve", "smollm2-135m", "--triforce-config", "[1]"], "JSON object"),
    (["serve", "/no/such/folder"], "model must be one of"),
])
def test_serve_options_are_checked_before_starting(argv, named):
    with pytest.raises(SystemExit, match=named):
        main(argv)


def test_replicas_and_autoscaling_are_deployment_options():
    from hf_triforce.serving.launch import deployment_options

    fixed = deployment_options(3, None, 4, 16)
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 4}
    scaled = deployment_options(1, '{"min_replicas": 1, "max_replicas": 4}', None, 16)
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4} and "num_replicas" not in scaled
    with pytest.raises(ValueError, match="--autoscaling"):
        deployment_options(1, "{max", None, 16)


def test_transformers_serve_request_handling_contract():
    """What the server takes from `transformers serve` (`compat.ServeRequestHandling`): 422 for a foreign field,
    the chat template with the generation prompt, OpenAI fields mapped to ``generate`` arguments."""
    from fastapi import HTTPException
    from transformers import GenerationConfig

    from hf_triforce.compat import ServeRequestHandling

    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}t0 {{ m['content'] }} t1 {% endfor %}" \
                              "{% if add_generation_prompt %}t2{% endif %}"
    serve = ServeRequestHandling(tokenizer)
    body = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 7, "stop": ["t9"], "seed": 3,
            "temperature": 0}
    serve.validate("chat", body)
    with pytest.raises(HTTPException) as refused:
        serve.validate("chat", {**body, "colour": "red"})
    assert refused.value.status_code == 422
    assert torch.as_tensor(serve.render_chat(body)["input_ids"]).reshape(-1).tolist() == [0, 5, 6, 1, 2]
    kwargs = serve.generation_kwargs("chat", body, GenerationConfig())
    assert (kwargs["max_new_tokens"], kwargs["stop_strings"], kwargs["seed"], kwargs["do_sample"]) == (7, ["t9"], 3,
                                                                                                      False)
    assert serve.generation_kwargs("text", {"prompt": "t5", "max_tokens": 2}, GenerationConfig())["max_new_tokens"] == 2
