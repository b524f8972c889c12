"""A word-level tokenizer over the tiny models' vocabulary ("t0" .. "tN"), built offline."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def word_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["abcdef"] = vocab_size - 2  # the probe word of transformers' StopStringCriteria
    vocab["<unk>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>")


def text_of(ids) -> str:
    return " ".join(f"t{i}" for i in ids)
