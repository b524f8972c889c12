"""`patches/transformers-<minor>-triforce.diff` applies to the installed transformers and does what the README says.

One diff per supported transformers minor release, each against its ``.0`` (`patches/README.md`): the one of the
installed version's minor release is tested; a minor release without one fails (regenerate the diff then). The patch
is applied to a scratch copy of the installed package; every check of the patched code runs in a subprocess that
imports that copy (``PYTHONPATH``), so this process keeps the installed transformers and computes the reference
outputs with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "patches" / "README.md"
# {"5.24": patches/transformers-5.24-triforce.diff, ...}: each diff is against the .0 of its minor release and is
# tested on any release of that minor (a patch release that changed a patched file fails to apply: regenerate then)
PATCHES = {
    match.group(1): path
    for path in sorted((ROOT / "patches").glob("transformers-*-triforce.diff"))
    if (match := re.fullmatch(r"transformers-(\d+\.\d+)-triforce\.diff", path.name))
}
PATCH = PATCHES.get(".".join(transformers.__version__.split(".")[:2]))
NEW_TOKENS = 24
TIMEOUT_S = 120


def tiny_llama(attn_implementation: str = "sdpa"):
    """A random GQA Llama (hidden 64, 2 layers, 4 query heads over 2 KV heads, vocabulary 96), no hub access."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = attn_implementation
    return model


def periodic_prompt(length: int = 100, period: int = 9) -> torch.Tensor:
    """Random tokens repeating with ``period``, so that n-gram lookup proposes candidates."""
    base = torch.randint(0, 96, (1, period), generator=torch.Generator().manual_seed(1))
    return base.repeat(1, length // period + 1)[:, :length]


# Runs in a subprocess against the patched copy (argv[1]); prints one JSON line of generated sequences.
CHECKS = r'''
import json, sys, tempfile

import torch
import transformers
from transformers import GenerationConfig, DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator, PromptLookupCandidateGenerator
from transformers.generation.streamers import BaseStreamer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward
from transformers import modeling_utils
from transformers.modeling_utils import record_attention_queries

from tests.test_upstream_patch import NEW_TOKENS, periodic_prompt, tiny_llama
from tests.tokenizer_util import word_tokenizer

root = sys.argv[1]
assert transformers.__file__.startswith(root), transformers.__file__
out = {}

# GenerationConfig.triforce_config: validated, serialized, round-trips, triggers assisted generation
TF = {"retrieval_budget": 64, "chunk_size": 8, "gamma1": 2, "gamma2": 4, "draft": "self"}
config = GenerationConfig(triforce_config=TF)
assert GenerationConfig.from_dict(config.to_dict()) == config
assert config.to_diff_dict()["triforce_config"] == TF
assert "triforce_config" not in GenerationConfig().to_diff_dict()
assert GenerationConfig.from_dict(json.loads(config.to_json_string()))
with tempfile.TemporaryDirectory() as saved:
    config.save_pretrained(saved)
    assert GenerationConfig.from_pretrained(saved).triforce_config == TF
assert config.get_generation_mode() == "assisted_generation"
assert GenerationConfig().get_generation_mode() == "greedy_search"
for bad in ({"triforce_config": "gamma2=4"}, {"triforce_config": {"draft": object()}}, {"triforce_config": {1: 2}},
            {"triforce_config": TF, "num_beams": 2}):
    try:
        GenerationConfig(**bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"GenerationConfig accepted {bad}")

model, prompt = tiny_llama("sdpa"), periodic_prompt()
greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
seq = lambda ids: ids[0].tolist()
out["greedy_sdpa"] = seq(model.generate(prompt, **greedy))
out["greedy_eager"] = seq(tiny_llama("eager").generate(prompt, **greedy))
# assisted decoding verifies several tokens per forward: the masked GQA SDPA path of the patch
out["prompt_lookup"] = seq(model.generate(prompt, prompt_lookup_num_tokens=3, **greedy))

# pre-filled cache= with assisted decoding (the first verification forward skips the cached prompt)
cache = DynamicCache(config=model.config)
with torch.no_grad():
    model(prompt[:, :-5], cache=cache)
out["prefilled_prompt_lookup"] = seq(model.generate(prompt, cache=cache, prompt_lookup_num_tokens=3, **greedy))

# masked multi-token SDPA folds GQA query heads into rows: same numbers as eager attention
attn = model.model.layers[0].self_attn
torch.manual_seed(2)
q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
mask = torch.ones(5, 20, dtype=torch.bool).tril(15)[None, None]
additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
packed, _ = sdpa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
reference, _ = eager_attention_forward(attn, q, k, v, additive, scaling=attn.scaling)
assert torch.allclose(packed, reference, atol=1e-5), (packed - reference).abs().max()

# custom_generate callables receive tokenizer= and streamer= when they name them; stop strings work either way
class Streamer(BaseStreamer):
    def put(self, value): pass
    def end(self): pass
tokenizer, streamer, seen = word_tokenizer(), Streamer(), {}
def named(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
          tokenizer=None, streamer=None, **model_kwargs):
    seen["named"] = (tokenizer, streamer, [type(c).__name__ for c in stopping_criteria], sorted(model_kwargs))
    return input_ids
def unnamed(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **model_kwargs):
    seen["unnamed"] = (None, None, [type(c).__name__ for c in stopping_criteria], sorted(model_kwargs))
    return input_ids
for fn in (named, unnamed):
    model.generate(prompt, custom_generate=fn, tokenizer=tokenizer, streamer=streamer, stop_strings=["t5"], **greedy)
assert seen["named"][0] is tokenizer and seen["named"][1] is streamer, seen["named"]
for name in ("named", "unnamed"):
    assert "StopStringCriteria" in seen[name][2], seen[name]
    assert not {"tokenizer", "streamer", "stop_strings"} & set(seen[name][3]), seen[name]

# candidate_generator=: an instance drives assisted decoding (no candidates: plain greedy)
class NoDraft(CandidateGenerator):
    def get_candidates(self, input_ids, **kwargs):
        return input_ids, None
out["candidate_instance"] = seq(model.generate(prompt, candidate_generator=NoDraft(), **greedy))

# ... and a factory builds one; requires_verifier_queries hands it the verification forward's queries
class Spy(PromptLookupCandidateGenerator):
    requires_verifier_queries = True
    def __init__(self, *, model, input_ids, generation_config, logits_processor, **kwargs):
        super().__init__(eos_token_id=generation_config._eos_token_tensor, num_output_tokens=3,
                         max_length=generation_config.max_length, logits_processor=logits_processor,
                         vocab_size=model.config.vocab_size)
        self.triforce_config, self.candidates, self.updates = generation_config.triforce_config, [], []
    def get_candidates(self, input_ids, **kwargs):
        candidates, logits = super().get_candidates(input_ids, **kwargs)
        self.candidates.append(candidates.clone())
        return candidates, logits
    def update_candidate_strategy(self, input_ids, scores, num_matches, **verifier_outputs):
        self.updates.append((scores.shape[1], verifier_outputs["verifier_queries"]))
made = []
def factory(**kwargs):
    made.append(Spy(**kwargs))
    return made[-1]
out["candidate_factory"] = seq(model.generate(prompt, candidate_generator=factory, **greedy))
out["candidate_triforce_config"] = seq(
    model.generate(prompt, candidate_generator=factory, triforce_config=TF, **greedy))
spy, spy_tf = made
assert spy.triforce_config is None and spy_tf.triforce_config == TF
assert any(rows > 1 for rows, _ in spy.updates), "prompt lookup proposed no candidate"
for rows, queries in spy.updates:
    assert sorted(queries) == [0, 1] and all(tuple(t.shape) == (1, 4, rows, 16) for t in queries.values())
# the recorded rows are layer 0's post-RoPE queries of the last rows of the first verification forward
ids, (rows, queries) = spy.candidates[0], spy.updates[0]
with torch.no_grad():
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
    layer = model.model.layers[0]
    raw = layer.self_attn.q_proj(layer.input_layernorm(hidden)).view(1, ids.shape[1], 4, 16).transpose(1, 2)
    expected = apply_rotary_pos_emb(raw, raw, cos, sin)[0][:, :, -rows:]
assert torch.allclose(queries[0], expected, atol=1e-5), (queries[0] - expected).abs().max()
# the recorder is off outside its context
with record_attention_queries() as everything, torch.no_grad():
    model(prompt)
assert tuple(everything[1].shape) == (1, 4, prompt.shape[1], 16) and modeling_utils._ACTIVE_QUERY_RECORDER is None

# bare triforce_config= reaches the config (not rejected as an unused model kwarg) and asks for the tiers
try:
    model.generate(prompt, triforce_config=TF, **greedy)
except ValueError as err:
    assert "candidate_generator" in str(err), err
else:
    raise AssertionError("triforce_config= without candidate_generator= ran")
try:
    model.generate(prompt, candidate_generator=NoDraft(), num_beams=2, max_new_tokens=4)
except ValueError as err:
    assert "candidate_generator" in str(err), err
else:
    raise AssertionError("candidate_generator= with beam search ran")

# hf_triforce still works on the patched transformers (imported last: it wraps generate)
from dataclasses import replace
from hf_triforce import TriForceCandidateGenerator, TriForceConfig
cfg = TriForceConfig(draft="self", retrieval_budget=32, chunk_size=8, sink_tokens=4, window=24, gamma1=2, gamma2=4)
out["hf_triforce"] = seq(model.generate(prompt, triforce_config=cfg, **greedy))
out["hf_triforce_assisted_loop"] = seq(model.generate(prompt, triforce_config=replace(cfg, loop="assisted"), **greedy))

# the real generator as candidate_generator=: transformers builds it (a factory) with the call's generation config
# (triforce_config as a dict), processors and cache, and hands it the verification forward's queries
built = []
def triforce(**kwargs):
    built.append(TriForceCandidateGenerator(**kwargs))
    return built[-1]
TRIFORCE = {"draft": "self", "retrieval_budget": 32, "chunk_size": 8, "sink_tokens": 4, "window": 24, "gamma1": 2,
            "gamma2": 4, "draft_precision": "model"}
out["triforce_candidate_generator"] = seq(
    model.generate(prompt, candidate_generator=triforce, triforce_config=TRIFORCE, **greedy))
out["triforce_candidate_generator_class"] = seq(
    model.generate(prompt, candidate_generator=TriForceCandidateGenerator, triforce_config=TRIFORCE, **greedy))
stats = built[0].stats
assert stats.force3_steps > 0 and stats.force3_proposed > 0 and stats.detail.retrieval_selections > 1, stats
assert not stats.detail.force2_sees_whole_cache and built[0].queries is not None
torch.manual_seed(0)
sampled = model.generate(prompt, candidate_generator=TriForceCandidateGenerator, triforce_config=TRIFORCE,
                         max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20)
assert sampled.shape[1] == prompt.shape[1] + NEW_TOKENS
try:
    padded = torch.ones_like(prompt).index_fill(1, torch.tensor([0]), 0)
    model.generate(prompt, candidate_generator=TriForceCandidateGenerator, attention_mask=padded,
                   triforce_config=TRIFORCE, **greedy)
except ValueError as err:
    assert "padded prompt" in str(err), err
else:
    raise AssertionError("a padded prompt ran on generate()'s cache")
print(json.dumps(out))
'''


def _run(args: list[str], patched_root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(patched_root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _patch() -> Path:
    """The diff against the installed transformers; fails, naming the versions there are diffs for, where none is."""
    assert PATCH is not None, (
        f"patches/ has no diff against the installed transformers {transformers.__version__} (diffs against: "
        f"{', '.join(PATCHES)}): regenerate one (patches/README.md)"
    )
    return PATCH


def _apply_command() -> list[str] | None:
    if shutil.which("patch"):
        return ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "-i", str(_patch())]
    if shutil.which("git"):
        return ["git", "apply", "-p1", "--verbose", str(_patch())]
    return None


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory) -> Path:
    """A scratch copy of the installed transformers with the patch applied (the directory to put on PYTHONPATH)."""
    _patch()  # fails where there is no diff against the installed version
    command = _apply_command()
    if command is None:
        pytest.skip("neither `patch` nor `git` is installed: the upstream patch cannot be applied here")
    root = tmp_path_factory.mktemp("patched-transformers")
    shutil.copytree(
        Path(transformers.__file__).parent, root / "transformers", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    # GIT_CEILING_DIRECTORIES: `git apply` must not resolve paths against some repository above the scratch copy
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    applied = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    report = applied.stdout + applied.stderr
    assert applied.returncode == 0, report
    assert not re.search(r"offset|fuzz|hunk .*failed", report, re.IGNORECASE), report
    return root


def _patched_files(patch: Path) -> list[str]:
    diff = patch.read_text()
    sources = re.findall(r"^--- a/(\S+)$", diff, re.MULTILINE)
    targets = re.findall(r"^\+\+\+ b/(\S+)$", diff, re.MULTILINE)
    assert sources and sources == targets, patch.name
    assert all(path.startswith("transformers/") and path.endswith(".py") for path in targets), patch.name
    return targets


def test_every_diff_patches_the_same_files_and_the_readme_names_it():
    """The diffs are one change ported across versions: the same files, each diff named in the README."""
    assert PATCHES, "no patches/transformers-<minor>-triforce.diff"
    readme = README.read_text()
    files = {version: _patched_files(patch) for version, patch in PATCHES.items()}
    for version, patch in PATCHES.items():
        assert f"`{patch.name}`" in readme, f"patches/README.md does not name {patch.name}"
        assert files[version] == next(iter(files.values())), (version, files)


def test_patch_is_a_unified_diff_of_the_files_the_readme_explains(patched_root):
    readme = README.read_text()
    for path in _patched_files(_patch()):
        assert f"`{path}`" in readme, f"patches/README.md does not explain {path}"
        assert (patched_root / path).read_text() != (Path(transformers.__file__).parent.parent / path).read_text()


def test_patched_transformers_keeps_outputs_and_adds_the_hooks(patched_root):
    run = _run(["-c", CHECKS, str(patched_root)], patched_root)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    patched = json.loads(run.stdout.strip().splitlines()[-1])
    # references from the installed (unpatched) transformers in this process
    prompt = periodic_prompt()
    expected = {
        attn: tiny_llama(attn).generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
        for attn in ("sdpa", "eager")
    }
    assert len(expected["sdpa"]) == prompt.shape[1] + NEW_TOKENS
    assert patched.pop("greedy_eager") == expected["eager"]
    for name, sequence in patched.items():
        assert sequence == expected["sdpa"], name


CONTRACT = (
    "import sys, pytest, transformers\n"
    "assert transformers.__file__.startswith(sys.argv[1]), transformers.__file__\n"
    "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_integration_contract.py']))\n"
)


def test_contract_tests_pass_against_patched_transformers(patched_root):
    run = _run(["-c", CONTRACT, str(patched_root)], patched_root)
    if run.returncode != 0:  # say whether the patch is to blame: the same file against the installed transformers
        installed = Path(transformers.__file__).parent.parent
        baseline = _run(["-c", CONTRACT, str(installed)], installed)
        verdict = (
            "they fail against the installed (unpatched) transformers too: not caused by the patch"
            if baseline.returncode != 0
            else "they pass against the installed transformers: the patch breaks them"
        )
        pytest.fail(f"tests/test_integration_contract.py fails against the patched copy; {verdict}\n"
                    + run.stdout[-6000:] + run.stderr[-3000:])
    assert re.search(r"\b\d+ passed\b", run.stdout) and "failed" not in run.stdout, run.stdout[-2000:]
