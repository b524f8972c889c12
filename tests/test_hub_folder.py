"""The repository's ``hub/`` folder is a transformers ``custom_generate`` repository: run from the repository root,
``model.generate(ids, custom_generate="hub", trust_remote_code=True, triforce_config=...)`` runs TriForce, greedy
token-identical to plain ``generate``, whether ``hf_triforce`` was imported first (its ``generate`` wrapper passes
``triforce_config=`` on) or not (the folder's ``generate.py`` imports it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"draft": "self", "policy": "fixed", "retrieval_budget": 32, "chunk_size": 8, "sink_tokens": 4, "window": 24,
          "gamma1": 2, "gamma2": 4, "draft_precision": "model"}
NEW_TOKENS = 24


def tiny_model_and_prompt():
    """A random GQA Llama and a prompt, built with transformers alone (the subprocess must not import hf_triforce)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1)).repeat(1, 9)
    return model, prompt


# Runs from the repository root in a fresh interpreter; prints the continuation as one JSON line.
FRESH = r'''
import json, sys
from tests.test_hub_folder import CONFIG, NEW_TOKENS, tiny_model_and_prompt

model, prompt = tiny_model_and_prompt()
assert "hf_triforce" not in sys.modules
out = model.generate(prompt, custom_generate="hub", trust_remote_code=True, triforce_config=CONFIG,
                     max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
assert "hf_triforce" in sys.modules and out.triforce_stats.force3_steps > 0, out
print(json.dumps(out.sequences[0].tolist()))
'''


def test_hub_folder_runs_triforce_after_import(monkeypatch, tmp_path):
    from hf_triforce import TriForceConfig

    monkeypatch.chdir(ROOT)
    model, prompt = tiny_model_and_prompt()
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    for config in (TriForceConfig(**CONFIG), TriForceConfig(**CONFIG, loop="assisted"), CONFIG):
        out = model.generate(prompt, custom_generate="hub", trust_remote_code=True, triforce_config=config,
                             max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected) and out.triforce_stats.force3_steps > 0, config


def test_hub_folder_runs_triforce_in_a_fresh_interpreter():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", FRESH], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    model, prompt = tiny_model_and_prompt()
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == expected[0].tolist()


def test_hub_card_is_a_custom_generate_card():
    card = (ROOT / "hub" / "README.md").read_text()
    header = card.split("---")[1]
    assert "library_name: transformers" in header and "- custom_generate" in header
    for section in ("## Base model", "## Model compatibility", "## Additional arguments", "## Output type changes"):
        assert section in card, section
    requirements = (ROOT / "hub" / "custom_generate" / "requirements.txt").read_text().split()
    assert any(line.startswith("hf-triforce") for line in requirements)
