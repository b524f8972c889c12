"""Every entry of transformers' decoder-only list (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) under TriForce.

For each entry: its default config shrunk generically (2 layers, hidden size 64, vocabulary 96, window 16, small
MoE / MLA dimensions), built with random weights when that gives a small model, then plain greedy ``generate`` and
three-level TriForce (``--draft``, 32-entry retrieval budget, 80-token prompt, 12 new tokens). Outcome per entry:

- ``identical``: token-identical to plain ``generate``;
- ``DIFFERS``: not identical (a bug);
- ``refused``: a ValueError from TriForce naming what is unsupported (the message is kept);
- ``crash``: any other exception from TriForce (a bug: a TypeError/AttributeError must never reach a user);
- ``not built`` / ``plain fails``: the generic shrink does not give a working tiny model of this entry (its own
  config validation, or plain ``generate`` failing on it): not a TriForce outcome; ``static`` then says what
  TriForce's layer-type check makes of the entry's default config (refused by name, or supported).

Usage: ``python benchmarks/family_sweep.py --draft self --out sweep-self.json [model_type ...]``. Runs under a
12 GiB address-space limit so that an entry whose shrink fails cannot exhaust the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import traceback
import warnings
from collections import Counter

import torch
import transformers as T
from tqdm.auto import tqdm
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_triforce import TriForceConfig
from hf_triforce.compat import layer_windows

SHRINK = dict(
    num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2, decoder_layers=2,
    hidden_size=64, n_embd=64, d_model=64, n_embed=64, embed_dim=64, dim=64,
    intermediate_size=96, n_inner=96, ffn_dim=96, decoder_ffn_dim=96, ffn_hidden_size=96,
    num_attention_heads=4, n_head=4, n_heads=4, decoder_attention_heads=4, num_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=96, max_position_embeddings=2048, n_positions=2048, sliding_window=16, rotary_dim=8,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, num_experts_per_topk=2, n_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, topk_group=1, n_group=1, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    kv_lora_rank=16, q_lora_rank=16, hidden_size_per_layer_input=0,
)
MAX_PARAMETERS = 20_000_000  # a shrink that leaves more than this did not reach the model's real dimensions


def tiny_config(model_type: str):
    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    nested = [value for value in vars(config).values() if isinstance(value, PretrainedConfig)]  # vision, audio
    for sub in nested:
        for name, value in dict(image_size=32, patch_size=8).items():
            if isinstance(getattr(sub, name, None), int):
                setattr(sub, name, value)
    for target in {id(c): c for c in (config, text, *nested)}.values():
        for name, value in SHRINK.items():
            current = getattr(target, name, None)
            if current is not None and not isinstance(current, (list, dict)):
                try:
                    setattr(target, name, value)
                except AttributeError:  # a read-only property derived from other fields
                    pass
        if getattr(target, "qk_rope_head_dim", None) is not None and hasattr(target, "head_dim"):
            target.head_dim = target.qk_rope_head_dim  # multi-head latent attention: RoPE on its own dims
            if hasattr(target, "num_key_value_heads"):
                target.num_key_value_heads = target.num_attention_heads
        if isinstance(getattr(target, "layer_types", None), list):
            target.layer_types = target.layer_types[: getattr(target, "num_hidden_layers", 2)]
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if hasattr(target, name):
                setattr(target, name, None)
    return config


def build(model_type: str):
    config = tiny_config(model_type)
    model_class = getattr(T, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise MemoryError(f"the shrunk config still has {parameters / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    return model_class(config).eval()


def static_check(model_type: str) -> str:
    """What TriForce's layer-type check says of the entry's default (full-size) config, without building it."""
    try:
        layer_windows(CONFIG_MAPPING[model_type]())
    except ValueError as error:
        return f"refused: {str(error)[:200]}"
    except Exception as error:  # noqa: BLE001 - the config itself does not say
        return f"unknown ({type(error).__name__})"
    return "layer types supported"


def outcome(model_type: str, draft: str) -> dict:
    record = {"class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    try:
        model = build(model_type)
    except Exception as error:  # noqa: BLE001 - reported as the entry's outcome
        return {**record, "status": "not built", "error": f"{type(error).__name__}: {str(error)[:200]}",
                "static": static_check(model_type)}
    embeddings = model.get_output_embeddings()
    vocab = min(96, embeddings.weight.shape[0]) if embeddings is not None else 96
    prompt = torch.randint(3, vocab, (1, 80), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    except Exception as error:  # noqa: BLE001
        return {**record, "status": "plain fails", "error": f"{type(error).__name__}: {str(error)[:200]}",
                "static": static_check(model_type)}
    config = TriForceConfig(draft=draft, retrieval_budget=32, chunk_size=8, retrieval_recent=8, sink_tokens=4,
                            window=16, gamma1=2, gamma2=4, policy="fixed")
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=12, do_sample=False, triforce_config=config)
    except ValueError as error:
        return {**record, "status": "refused", "error": str(error)[:300]}
    except Exception as error:  # noqa: BLE001
        where = [f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" for frame in
                 traceback.extract_tb(error.__traceback__)[-3:]]
        return {**record, "status": "crash", "error": f"{type(error).__name__}: {str(error)[:300]}", "where": where}
    return {**record, "status": "identical" if torch.equal(out, expected) else "DIFFERS"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="entries to sweep (default: all)")
    parser.add_argument("--draft", default="self", help="TriForceConfig.draft (default: self)")
    parser.add_argument("--out", required=True, help="JSON file for the outcomes")
    args = parser.parse_args()
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))
    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    names = args.model_types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results = {}
    for name in tqdm(names, desc=f"sweep (draft={args.draft})", unit="model"):
        results[name] = outcome(name, args.draft)
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    print(json.dumps(Counter(r["status"] for r in results.values())))


if __name__ == "__main__":
    main()
