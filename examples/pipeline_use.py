"""TriForce through the transformers text-generation pipeline."""

from transformers import pipeline

import hf_triforce  # noqa: F401
from hf_triforce import TriForceConfig, assets

model, tokenizer = assets.load_smollm2()
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
prompt = assets.shakespeare("othello")[:6000]
config = TriForceConfig(draft="ngram", retrieval_budget=512)
print(generator(prompt, max_new_tokens=32, do_sample=False, triforce_config=config)[0]["generated_text"][-300:])
