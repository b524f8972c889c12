"""The bench's command line (`hf-triforce-bench`): argument handling, and a short end-to-end run of each command."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hf_triforce_bench import compare as bench
from hf_triforce_bench.cli import build_parser, main
from hf_triforce_bench.methods import DEFAULT_EXCLUDED, METHODS

from .conftest import make_model
from .tokenizer_util import text_of, word_tokenizer


@pytest.mark.parametrize(
    "argv",
    [
        ["decode", "--methods", "warp-drive"],
        ["decode", "--rope-factor", "0.5"],
        ["decode", "--top-p", "0"],
        ["decode", "--temperature", "-1"],
        ["decode", "--text", "klingon"],
        ["bench"],
        [],
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_bench_refuses_contexts_beyond_the_positions():
    with pytest.raises(SystemExit, match="--rope-factor"):
        main(["decode", "--contexts", "9000"])


def test_bench_names_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match=r"\['assisted'\] need --draft-model"):
        main(["decode", "--methods", "plain", "assisted"])
    with pytest.raises(SystemExit, match="--budget values must differ"):
        main(["decode", "--budget", "512", "512"])
    with pytest.raises(SystemExit, match="--model: model must be one of .*smollm2-135m"):
        main(["decode", "--model", str(tmp_path / "missing")])
    # a bundled model's trained positions (the Qwen pair's 32768, SmolLM2's 8192) bound the contexts, before the load
    with pytest.raises(SystemExit, match=r"contexts \[40000\] \+ new tokens exceed 32768 positions"):
        main(["decode", "--model", "qwen2.5-coder-1.5b", "--contexts", "40000"])
    with pytest.raises(SystemExit, match=r"contexts \[70000\] \+ new tokens exceed 65536 positions"):
        main(["decode", "--model", "qwen2.5-coder-1.5b", "--contexts", "70000", "--rope-factor", "2"])


def test_bench_runs_each_budget_on_a_tiny_local_model(tmp_path):
    model, tokenizer = make_model("llama-gqa"), word_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    bench_dir = tmp_path / "bench"
    assert main(["decode", "--model", str(tmp_path / "m"), "--prompt", "continue", "--contexts",
                 "120", "--new-tokens", "3", "--repeats", "1",
                 "--methods", "plain", "triforce-ngram", "--budget", "32", "48", "--gamma2", "5",
                 "--out", str(bench_dir)]) == 0
    results = (bench_dir / "results.md").read_text()
    assert "| triforce-ngram (budget 32) |" in results and "| triforce-ngram (budget 48) |" in results
    assert "| plain |" in results and "gamma1/gamma2 3/5 (lookup drafts)" in results
    saved = json.loads((bench_dir / "results.json").read_text())[0]
    assert saved["gammas"] == {"lookup": [3, 5], "model": [2, 5]} and saved["budgets"] == [32, 48]
    assert set(saved["methods"]) == {"plain", "triforce-ngram (budget 32)", "triforce-ngram (budget 48)"}
    ids = {name: m["new_token_ids"] for name, m in saved["methods"].items()}  # the decoded continuation, recorded
    assert all(len(i) == 3 for i in ids.values()) and len({tuple(i) for i in ids.values()}) == 1, ids
    with pytest.raises(SystemExit, match="rope-factor applies"):
        main(["decode", "--model", str(tmp_path / "m"), "--rope-factor", "2"])


def test_bench_with_a_draft_model_and_sampling(tmp_path, capsys):
    target, draft, tokenizer = make_model("llama-gqa"), make_model("llama-mha", seed=3), word_tokenizer()
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    out_dir = tmp_path / "bench"
    argv = ["decode", "--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"), "--prompt",
            "continue", "--contexts",
            "120", "--new-tokens", "4", "--repeats", "2", "--budget", "32", "--out", str(out_dir)]
    assert main(argv + ["--methods", "plain", "assisted", "triforce-draft", "vanilla", "--modes", "greedy"]) == 0
    greedy = json.loads((out_dir / "results.json").read_text())[0]
    assert greedy["sampling"] is None and set(greedy["methods"]) == {"plain", "assisted", "triforce-draft", "vanilla"}
    rows = [line for line in (out_dir / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert all(line.endswith("| yes |") for line in rows[1:]), rows  # greedy: every method equals plain
    stats = greedy["methods"]["triforce-draft"]["stats"]
    assert stats["detail"]["force1_proposed"] > 0 and len(greedy["methods"]["assisted"]["seconds"]) == 2
    # vanilla speculative decoding: the draft on a cache holding the whole sequence, two levels; its pass over the
    # prompt is prompt processing, reported and not timed
    vanilla = greedy["methods"]["vanilla"]["stats"]
    assert vanilla["plan_steps"] == {"2": vanilla["force3_steps"]} and vanilla["detail"]["draft_prefill_seconds"] > 0
    # no warm-up call repeats the draft's pass over the prompt: its first timed call makes the copies, reported and
    # subtracted with the other one-off set-up seconds
    from hf_triforce_bench.compare import warms_up
    from hf_triforce_bench.methods import method_named
    assert not warms_up(method_named("vanilla")) and warms_up(method_named("triforce-draft"))
    assert warms_up(method_named("static-compiled")) and not warms_up(method_named("plain"))
    assert vanilla["detail"]["draft_precision"] == "lean-int4" and greedy["methods"]["vanilla"]["copy_seconds"] > 0
    # default methods with a draft model: all of them; sampling: seeded, no identity claim
    assert main(argv + ["--sample", "--temperature", "0.7", "--top-p", "0.9"]) == 0
    sampled = json.loads((out_dir / "results.json").read_text())[0]
    assert set(sampled["methods"]) == set(METHODS) - set(DEFAULT_EXCLUDED)
    # transformers' best plain decoding: static eager and compiled (warmed up apart), the faster one named
    assert sampled["best_plain"] in ("static", "static-compiled")
    assert sampled["methods"]["static-compiled"]["compile_seconds"] > 0
    # a first call's drafting weight copies (the default's lean-int4 copy of the fp32 target) made by a warm-up call
    # outside the timed rounds, and reported; the library default with the draft model drafts with it
    default = sampled["methods"]["default"]
    assert default["stats"]["detail"]["draft_precision"] == "lean-int4" and default["copy_seconds"] > 0
    assert sampled["methods"]["plain"]["copy_seconds"] is None  # a baseline: no warm-up
    assert "model" in sampled["methods"]["default-draft"]["stats"]["detail"]["draft_caches"]
    assert f"vs best plain ({sampled['best_plain']})" in (out_dir / "results.md").read_text()
    assert sampled["sampling"] == {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert all(m["new_tokens"] == 4 for m in sampled["methods"].values())
    assert "n/a (sampled)" in (out_dir / "results.md").read_text()
    assert "sampling (temperature 0.7, top-p 0.9)" in capsys.readouterr().out


def test_bench_and_needle_end_to_end_on_smollm2(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    assert main(["decode", "--contexts", "200", "--new-tokens", "4", "--repeats", "1", "--methods", "plain",
                 "static", "triforce-ngram", "--budget", "64", "--text", "essays", "shakespeare", "--modes", "greedy",
                 "--out", str(out_dir)]) == 0
    results = json.loads((out_dir / "results.json").read_text())
    assert [r["text"] for r in results] == ["essays", "shakespeare"]
    assert set(results[0]["methods"]) == {"plain", "static", "triforce-ngram"}
    assert bench.speedups(results[1])["static"] == 1.0 and results[1]["best_plain"] == "static"
    assert "| triforce-ngram |" in (out_dir / "results.md").read_text()
    assert (out_dir / "results.png").stat().st_size > 1000
    capsys.readouterr()
    assert main(["needle", "--context", "600", "--budget", "128", "--depths", "0.5"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.50 |")]
    assert len(row) == 1 and len(row[0].split("|")) == 8


def test_needle_acceptance_on_a_tiny_model():
    from hf_triforce_bench.needle import needle_prompt, tier_acceptance

    tokenizer = word_tokenizer()
    haystack = text_of([i % 90 for i in range(7, 700)])
    prompt, answer = needle_prompt(tokenizer, haystack, 300, 0.5, code="t91 t92 t93")
    assert prompt.shape[1] == 300
    model = make_model("llama-gqa")
    small = tier_acceptance(model, prompt, answer, budget=64)
    for key in ("retrieval_acceptance", "streaming_acceptance", "retrieval_greedy", "streaming_greedy"):
        assert 0.0 <= small[key] <= 1.0
    whole = tier_acceptance(model, prompt, answer, budget=512)  # the budget holds the whole prompt
    assert whole["retrieval_acceptance"] > 0.999 and whole["retrieval_greedy"] == 1.0
    with pytest.raises(ValueError, match="depth"):
        needle_prompt(tokenizer, haystack, 300, 1.5, code="t1")


def test_bench_gammas_default_per_drafter_and_reach_the_config():
    from hf_triforce_bench.compare import method_kwargs
    from hf_triforce_bench.methods import TUNED_GAMMAS

    model = make_model("llama-gqa")
    ngram = method_kwargs("triforce-ngram", model, None, 200, 32)["triforce_config"]
    self_draft = method_kwargs("triforce-self-int8", model, None, 200, 32, gammas=(None, 4))["triforce_config"]
    assert (ngram.gamma1, ngram.gamma2) == TUNED_GAMMAS["lookup"]
    assert (self_draft.gamma1, self_draft.gamma2) == (TUNED_GAMMAS["model"][0], 4)
    assert method_kwargs("streaming-self", model, None, 200, 32, gammas=(5, 9))["triforce_config"].gamma2 == 4
    window = method_kwargs("triforce-suffix", model, None, 200, 32, knobs={"window": 40})["triforce_config"]
    assert window.window == 40 and window.draft == "suffix"


def test_methods_are_records_derived_from_the_drafter_registry():
    from hf_triforce.drafters import DRAFTERS

    for name in DRAFTERS:
        label = "draft" if name == "model" else name
        assert METHODS[f"triforce-{label}"].drafter == label and METHODS[f"triforce-{label}-int8"].precision == "int8"
    assert METHODS["streaming-self"].levels == 2 and METHODS["plain"].baseline
    assert METHODS["assisted"].needs_draft_model and METHODS["triforce-draft"].needs_draft_model


class ScriptedEngine:
    """Stands in for `LlamaCppEngine` (llama-cpp-python is optional): the same ``decode`` contract, returning
    the reference continuation with its token ``differ_at`` changed."""

    def __init__(self, reference, differ_at: int):
        self.reference, self.differ_at, self.calls, self.prefill_seconds = reference, differ_at, [], 0.0

    def decode(self, ids, new_tokens, sampling, seed):
        self.calls.append((new_tokens, sampling, seed))
        out = self.reference[:, : ids.shape[1] + new_tokens].clone()
        out[0, ids.shape[1] + self.differ_at] += 1
        return 0.5, out


def test_bench_runs_another_engine_beside_transformers():
    from hf_triforce_bench.compare import compare, table

    model = make_model("llama-gqa")
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(0))
    reference = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    engine = ScriptedEngine(reference, differ_at=4)
    with pytest.raises(ValueError, match=r"\['llama.cpp'\] run another engine"):
        compare(model, ids, ["plain", "llama.cpp"], 6, 1, 32)
    runs, _ = compare(model, ids, ["plain", "llama.cpp"], 6, 2, 32, engines={"llama.cpp": engine})
    assert engine.calls == [(6, None, 0), (6, None, 1)]
    assert runs[1].tokens_per_second == pytest.approx(12.0)
    assert "| first 4/6 tokens |" in table(runs)
    assert "n/a (sampled)" in table(runs, sampled=True)


def test_a_peer_engine_that_crashes_is_reported_and_the_bench_runs_on():
    """A peer engine runs in its own process (`PeerProcess`): its Python errors reach the bench with the child's
    traceback, and its process dying (here os.abort() on the second decode; llama.cpp's segfaults alike) marks its row
    crashed while the other methods finish every round. Run in the bench's own process, the abort kills the suite."""
    from hf_triforce_bench.compare import compare, speedups, table, to_json
    from hf_triforce_bench.peer_process import PeerCrashed, PeerProcess

    from .peer_stand_ins import AbortingEngine

    model = make_model("llama-gqa")
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    engine = PeerProcess("llama.cpp", AbortingEngine, {"tokens_per_second": 12.0})
    try:
        with pytest.raises(RuntimeError, match="(?s)llama.cpp failed in its process during call 1.*ValueError: this "
                           "stand-in has no prefill"):
            engine.prefill(ids)
        runs, _ = compare(model, ids, ["plain", "llama.cpp"], 4, 3, 32, engines={"llama.cpp": engine})
    finally:
        engine.close()
    plain, peer = runs
    assert len(plain.seconds) == 3 and plain.tokens_per_second > 0
    assert len(peer.seconds) == 1 and peer.crashed == "llama.cpp was killed by signal SIGABRT during call 3 (decode)"
    assert "| llama.cpp | crashed: llama.cpp was killed by signal SIGABRT during call 3 (decode) |" in table(runs)
    result = to_json(40, runs, 0.0)
    assert result["methods"]["llama.cpp"]["decode_tokens_per_second"] is None
    assert set(speedups(result)) == {"plain"}
    with pytest.raises(PeerCrashed, match="SIGABRT"):
        engine.decode(ids, 4, None, 0)


def test_bench_llama_cpp_methods_need_a_bundled_gguf(tmp_path):
    with pytest.raises(SystemExit, match="run llama.cpp on a bundled GGUF"):
        main(["decode", "--model", str(tmp_path), "--methods", "plain", "llama.cpp"])
    assert METHODS["llama.cpp-lookup"].engine == "llama.cpp" and "llama.cpp" in DEFAULT_EXCLUDED


def test_bench_times_no_methods_prefix_copy(monkeypatch):
    """Every method starts from the bench's shared prefix; static and plain copy it before the clock, so a TriForce
    run's own copy of it (`TriForceDetail.prefix_copy_seconds`, measured in `generate`) is not timed either."""
    model = make_model()
    prompt = torch.randint(0, model.config.vocab_size, (1, 40))
    prefix = bench.prefill_prefix(model, prompt)
    out = model.generate(prompt, cache=bench.prefill_prefix(model, prompt), max_new_tokens=3, do_sample=False,
                         triforce_config=METHODS["default"].config(64), return_dict_in_generate=True)
    assert out.triforce_stats.detail.prefix_copy_seconds > 0
    assert model.generate(prompt, max_new_tokens=3, do_sample=False, triforce_config=METHODS["default"].config(64),
                          return_dict_in_generate=True).triforce_stats.detail.prefix_copy_seconds == 0
    generate = model.generate

    def slow_generate(*args, **kwargs):  # 0.3 s at least, of which its copy says 0.25 s
        time.sleep(0.3)
        result = generate(*args, **kwargs)
        result.triforce_stats.detail.prefix_copy_seconds = 0.25
        return result

    monkeypatch.setattr(model, "generate", slow_generate)
    run = bench.Run("default")
    began = time.perf_counter()
    bench.measure(model, prompt, prefix, "default", 3, 64, run)
    wall = time.perf_counter() - began
    assert 0.05 <= run.seconds[0] <= wall - 0.25


def test_bench_saves_a_prefill_and_reads_it_back_in_a_later_run(tmp_path, capsys):
    model, tokenizer = make_model("llama-gqa"), word_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    argv = ["decode", "--model", str(tmp_path / "m"), "--prompt", "continue", "--contexts", "120", "--new-tokens", "4",
            "--repeats", "1", "--methods", "plain", "--modes", "greedy", "--out", str(tmp_path / "bench"),
            "--prefill-dir", str(tmp_path / "prefills")]
    outputs = []
    for source in ("computed, saved to", "loaded"):
        assert main(argv) == 0
        assert f"prefill of essays at 120 tokens: {source}" in capsys.readouterr().out
        outputs.append(json.loads((tmp_path / "bench" / "results.json").read_text())[0]["methods"]["plain"])
    assert outputs[0]["new_token_ids"] == outputs[1]["new_token_ids"]
    assert len(list((tmp_path / "prefills").glob("prefill-119-*.safetensors"))) == 1


def test_bench_gguf_stored_width_names_what_it_needs(tmp_path):
    with pytest.raises(SystemExit, match="--gguf-stored-width without a file reads a bundled model's GGUF: --model"):
        main(["decode", "--model", str(tmp_path), "--gguf-stored-width"])
    with pytest.raises(SystemExit, match="--gguf-stored-width needs --dtype float32 .*got bfloat16"):
        main(["decode", "--gguf-stored-width", "--dtype", "bfloat16"])
