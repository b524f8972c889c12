"""llama.cpp as a second engine in the bench (optional: only where ``llama-cpp-python`` is installed).

The same GGUF file and the same number of threads as the transformers model, fed the same prompt token ids
(the vocabulary is the GGUF's), prefilled once per engine; every run then reuses that prefix (llama.cpp drops
the rest of its KV cache) and decodes ``new_tokens``: plain one-token decoding, or llama.cpp's prompt-lookup
speculative decoding (``LlamaPromptLookupDecoding``). llama.cpp computes with the GGUF's quantized weights
(Q4_1 for the bundled SmolLM2) where transformers runs them dequantized to fp32, so outputs agree only
approximately: this compares the engines as users get them, not the same arithmetic.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

LOOKUP_TOKENS = 10  # llama-cpp-python's documented setting for CPU prompt lookup (its default is 10 too)
ROPE_SCALING_YARN = 2  # llama.cpp's LLAMA_ROPE_SCALING_TYPE_YARN


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppEngine:
    """One llama.cpp context for prompts of up to ``context`` tokens plus ``new_tokens``.

    ``rope_factor``: YaRN scaling of the GGUF's trained positions ``original_positions`` (what the
    transformers model was loaded with), None for none. ``lookup``: prompt-lookup speculative decoding.
    """

    def __init__(self, gguf: Path, context: int, threads: int, lookup: bool = False,
                 rope_factor: float | None = None, original_positions: int = 8192) -> None:
        if not llama_cpp_available():
            raise ImportError("the llama.cpp methods need llama-cpp-python (pip install llama-cpp-python)")
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        rope = {} if rope_factor is None else dict(rope_scaling_type=ROPE_SCALING_YARN,
                                                   rope_freq_scale=1.0 / rope_factor,
                                                   yarn_orig_ctx=original_positions)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
        self.llm = Llama(str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         draft_model=draft, logits_all=lookup, verbose=False, **rope)
        self.prefill_seconds = 0.0

    def prefill(self, ids: torch.Tensor) -> float:
        """Evaluate every prompt token but the last (as the transformers baselines' shared prefill does)."""
        start = time.perf_counter()
        self.llm.reset()
        self.llm.eval(ids[0, :-1].tolist())
        self.prefill_seconds = time.perf_counter() - start
        return self.prefill_seconds

    def decode(self, ids: torch.Tensor, new_tokens: int, sampling: dict | None, seed: int
               ) -> tuple[float, torch.Tensor]:
        """``(seconds, sequences)`` of one run: greedy, or ``sampling`` (``temperature``, ``top_p``) seeded
        with ``seed``; top-k and min-p are off, as in transformers' sampling with those two settings."""
        if sampling:
            settings = dict(temp=float(sampling.get("temperature", 1.0)), top_p=float(sampling.get("top_p", 1.0)),
                            top_k=0, min_p=0.0)
        else:
            settings = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
        self.llm.set_seed(seed)
        prompt = ids[0].tolist()
        out = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt, repeat_penalty=1.0, **settings):
            out.append(token)
            if len(out) == new_tokens:
                break
        seconds = time.perf_counter() - start
        return seconds, torch.cat((ids, ids.new_tensor([out])), dim=1)
