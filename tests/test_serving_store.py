"""`PrefixStore` and `Engine` in one process: reused prefixes give the answers fresh prompts give (greedy), stored
caches are never written, entries on one document hold it once, the byte budget counts shared storage once and
evicts entries least recently used first, the longest shared prefix wins; and the ``serve`` command's options are
checked before anything starts."""

import gc
import os
import weakref

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
    """A `PrefixStore` that keeps a copy of each entry's tensors as it is stored (and where they live)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.copies = {}

    @staticmethod
    def _tensors(entry):
        return [tensor for chunk in entry.chunks for pair in chunk.layers for tensor in pair]

    def put(self, tokens, cache) -> bool:
        kept = super().put(tokens, cache)
        if kept:
            key = next(reversed(self._entries))
            self.copies[key] = [(tensor.data_ptr(), tensor.clone()) for tensor in self._tensors(self._entries[key])]
        return kept

    def unwritten(self) -> bool:
        """Whether every stored entry is still in the tensors it was stored in, bit for bit as it was stored."""
        return all(all(pointer == tensor.data_ptr() and torch.equal(copy, tensor)
                       for (pointer, copy), tensor in zip(self.copies[key], self._tensors(entry), strict=True))
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


def _questions(count: int) -> list[torch.Tensor]:
    """``count`` prompts ([309] each): one document of 300 tokens, then a question of 9 of its own."""
    document = random_prompt(300, period=23)[0]
    return [torch.cat([document, random_prompt(9, seed=s)[0]]) for s in range(5, 5 + count)]


def _equal(cache: DynamicCache, other: DynamicCache) -> bool:
    return len(cache.layers) == len(other.layers) and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(cache.layers, other.layers))


def test_questions_on_one_document_hold_it_once(sharp_model):
    """Four questions on one document: the store holds the document once and each question's own positions."""
    questions = _questions(4)
    one = cache_nbytes(_filled(sharp_model, questions[0]))
    store = PrefixStore(1 << 30, 16, sharp_model.config)
    for ids in questions:
        assert store.put(ids, _filled(sharp_model, ids))
    assert len(store) == 4 and store.nbytes <= 1.1 * one
    described = store.describe()
    assert described["bytes"] == store.nbytes and described["shared_bytes"] == one  # the first entry's cache
    assert described["unique_bytes"] == store.nbytes - one and described["entry_bytes"] == 4 * one
    assert described["chunks"] == [1, 2, 2, 2] and described["positions"] == [309] * 4


def test_lookups_equal_fresh_prefills_within_and_across_chunks(sharp_model):
    """A lookup's positions are bit for bit those of a fresh prefill of the stored prompt they come from, from one
    chunk (a view of the stored tensors) and across two (the second question's entry: the first's document, then
    its own positions). (A prefill of fewer tokens may round its positions differently: the reference is the
    stored prompt's.)"""
    first, second = _questions(2)
    stored = _filled(sharp_model, first)
    store = PrefixStore(1 << 30, 16, sharp_model.config)
    assert store.put(first, stored) and store.put(second, _filled(sharp_model, second))
    other = random_prompt(4, seed=11)[0]
    for prompt, source, length, view in ((first, first, 309, True), (torch.cat([first[:300], other]), first, 300, True),
                                         (torch.cat([second, other]), second, 309, False),
                                         (torch.cat([second[:305], other]), second, 305, False)):
        cache, reused = store.lookup(prompt)
        fresh = prefix_view(_filled(sharp_model, source), length, sharp_model.config)
        assert reused == length and _equal(cache, fresh)
        shares = cache.layers[0].keys.untyped_storage().data_ptr() == stored.layers[0].keys.data_ptr()
        assert shares == view  # one chunk: a view of the stored tensors; two: their concatenation


def test_eviction_frees_shared_storage_only_when_no_entry_uses_it(sharp_model):
    """Under a budget of one entry and two questions' positions, the fourth question evicts the first entry (whose
    document the others share: nothing is freed) and the second (its own positions are freed); an unrelated prompt
    then evicts the rest, and the document's tensors go."""
    questions = _questions(4)
    per_position = cache_nbytes(_filled(sharp_model, questions[0][:1]))
    one, own = 309 * per_position, 9 * per_position
    store = PrefixStore(one + 2 * own, 16, sharp_model.config)
    first = _filled(sharp_model, questions[0])
    document_keys = weakref.ref(first.layers[0].keys)
    assert store.put(questions[0], first)
    del first
    for ids in questions[1:3]:
        assert store.put(ids, _filled(sharp_model, ids))
    assert store.nbytes == one + 2 * own and len(store) == 3
    assert store.put(questions[3], _filled(sharp_model, questions[3]))
    assert store.nbytes == one + 2 * own and len(store) == 2 and document_keys() is not None
    assert store.describe()["shared_bytes"] == one and store.describe()["unique_bytes"] == 2 * own
    assert [store.lookup(ids)[1] for ids in questions] == [300, 300, 309, 309]
    unrelated = random_prompt(309, seed=12)[0]
    assert store.put(unrelated, _filled(sharp_model, unrelated))
    assert store.nbytes == one and len(store) == 1 and store.describe()["shared_bytes"] == 0
    gc.collect()
    assert document_keys() is None and store.lookup(questions[0]) == (None, 0)


def test_caches_from_lookups_extended_leave_the_store_unwritten(sharp_model):
    """A lookup's cache, a view of one chunk or a concatenation of two, extended by a forward: every stored tensor
    stays where and what it was."""
    store = RecordingStore(1 << 30, 16, sharp_model.config)
    for ids in _questions(3):
        assert store.put(ids, _filled(sharp_model, ids))
    for prompt, spans in ((_questions(1)[0], 1), (_questions(2)[1], 2)):
        cache, length = store.lookup(prompt)
        assert length == 309 and store._entries[next(reversed(store._entries))].spanned(length) == spans
        with torch.no_grad():
            sharp_model(random_prompt(8, seed=3), cache=cache)
        assert cache.get_seq_length() == 317 and store.unwritten()


def test_engine_answers_from_shared_entries_equal_fresh_ones(sharp_model):
    """Through the engine: the second question reuses the document from the first's entry, a follow-up to it the
    second's two chunks; each answer equals a fresh ``generate``, and the store holds the document once."""
    first, second = (ids[None] for ids in _questions(2))
    follow_up = torch.cat([second, random_prompt(6, seed=9)], dim=1)
    store = RecordingStore(1 << 30, 16, sharp_model.config)
    engine = Engine(sharp_model, word_tokenizer(), store, prefill_chunk_size=128)
    for ids, reused in ((first, 0), (second, 300), (follow_up, 308)):
        answer = engine.run(Job(ids, {"max_new_tokens": 24, "do_sample": False}, CONFIG))
        fresh = sharp_model.generate(ids, max_new_tokens=24, do_sample=False, triforce_config=CONFIG)
        assert answer.tokens == fresh[0, ids.shape[1]:].tolist()
        assert answer.figures["prefix_reused_tokens"] == reused and store.unwritten()
    described = store.describe()  # the follow-up's entry extends the second's, which is dropped
    assert described["positions"] == [308, 314] and described["chunks"] == [1, 3]
    assert described["bytes"] == cache_nbytes(_filled(sharp_model, first[0, :308])) * (308 + 14) // 308


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
    """What the server takes from `transformers serve` (`compat.ServeRequestHandling`): the chat template with the
    generation prompt, OpenAI fields mapped to ``generate`` arguments."""
    from transformers import GenerationConfig

    from hf_triforce.compat import ServeRequestHandling

    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}t0 {{ m['content'] }} t1 {% endfor %}" \
                              "{% if add_generation_prompt %}t2{% endif %}"
    serve = ServeRequestHandling(tokenizer)
    body = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 7, "stop": ["t9"], "seed": 3,
            "temperature": 0}
    assert torch.as_tensor(serve.render_chat(body)["input_ids"]).reshape(-1).tolist() == [0, 5, 6, 1, 2]
    kwargs = serve.generation_kwargs("chat", body, GenerationConfig())
    assert (kwargs["max_new_tokens"], kwargs["stop_strings"], kwargs["seed"], kwargs["do_sample"]) == (7, ["t9"], 3,
                                                                                                      False)
    assert serve.generation_kwargs("text", {"prompt": "t5", "max_tokens": 2}, GenerationConfig())["max_new_tokens"] == 2


def test_server_settings_from_serve_run_arguments():
    """``build_app``'s arguments (``serve run ... model=x max_batch_size=4``): strings parsed into the fields, an
    unknown field or a bad value named."""
    from hf_triforce.serving.deployment import settings_from_args

    settings = settings_from_args({"model": "smollm2-135m", "max_batch_size": "4", "threads": "none"})
    assert (settings.model, settings.max_batch_size, settings.threads) == ("smollm2-135m", 4, None)
    assert settings.niceness == os.getpriority(os.PRIO_PROCESS, 0)
    for args, named in [({"model": "m", "colour": "red"}, "colour"), ({}, "model"),
                        ({"model": "m", "max_batch_size": "many"}, "max_batch_size"),
                        ({"model": "m", "max_batch_size": "0"}, "max-batch-size"),
                        ({"model": "m", "triforce": "{bad"}, "triforce-config")]:
        with pytest.raises(ValueError, match=named):
            settings_from_args(args)


def test_streamed_pieces_are_the_decoded_text_held_back_inside_a_character():
    """`Detokenizer`: a byte-level tokenizer splits characters over tokens; the pieces never carry half a character
    and join to the text the whole answer decodes to."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_triforce.serving.deployment import Detokenizer

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = "Ophélie, née à Elseneur ✓ 你好 — fin."
    backend.train_from_iterator([text.replace("你好", "")], trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokens = tokenizer(text).input_ids
    assert len(tokens) > len(text.split())  # characters split over byte tokens
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in tokens]
    assert "".join(pieces) == tokenizer.decode(tokens) == text
    assert not any("\ufffd" in piece for piece in pieces) and "" in pieces  # held back, never half a character
