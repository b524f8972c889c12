"""A separate, smaller draft model (here: the first 10 layers of SmolLM2) as Force 1."""

import torch
from transformers import LlamaForCausalLM

import hf_triforce  # noqa: F401
from hf_triforce import TriForceConfig, assets

model, tokenizer = assets.load_smollm2()
draft_config = model.config.__class__.from_dict({**model.config.to_dict(), "num_hidden_layers": 10})
draft = LlamaForCausalLM(draft_config).eval()
draft.load_state_dict(model.state_dict(), strict=False)

ids = tokenizer(assets.shakespeare("king-lear"), return_tensors="pt").input_ids[:, :2048]
config = TriForceConfig(draft=draft, retrieval_budget=512, sink_tokens=16, window=256)
out = model.generate(ids, max_new_tokens=32, do_sample=False, triforce_config=config, return_dict_in_generate=True)
assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=32, do_sample=False))
print(tokenizer.decode(out.sequences[0, ids.shape[1]:]))
print(out.triforce_stats.to_dict())
