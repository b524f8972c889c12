"""The library's command line (`hf-triforce demo | generate | serve`): argument handling, and a short run of the demo
and of generate."""

from __future__ import annotations

import pytest

from hf_triforce.tools.cli import build_parser, main

from .conftest import make_model
from .tokenizer_util import text_of, word_tokenizer


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--context", "0"],
        ["demo", "--draft", "mystery"],
        ["demo", "--baselines", "plain"],
        ["demo", "--budget", "0"],
        ["generate"],
        ["bench"],  # the bench is `hf-triforce-bench` (hf_triforce_bench), not part of the library
        [],
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_bad_play_config_and_missing_prompt_file(tmp_path):
    with pytest.raises(SystemExit, match="--play must be one of"):
        main(["demo", "--play", "cats"])
    with pytest.raises(SystemExit, match="hf-triforce demo: TriForceConfig.window must exceed gamma1 "):
        main(["demo", "--window", "4"])  # TriForceConfig's own check, before the model loads
    with pytest.raises(SystemExit, match="does not exist"):
        main(["generate", "--prompt-file", str(tmp_path / "nope.txt")])


def test_generate_streams_on_a_tiny_local_model(tmp_path, capsys):
    model, tokenizer = make_model("llama-gqa"), word_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text_of(list(range(40)) * 3))
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-file", str(prompt), "--max-new-tokens", "6",
                 "--draft", "ngram", "--budget", "32", "--window", "16", "--stats", "--int8"]) == 0
    out = capsys.readouterr().out
    assert "force3_acceptance" in out and "'draft_precision': 'int8'" in out and out.split("{")[0].strip()


def test_demo_end_to_end_on_smollm2(capsys):
    assert main(["demo", "--context", "300", "--new-tokens", "6", "--draft", "ngram", "--budget", "64",
                 "--baselines", "static"]) == 0
    out = capsys.readouterr().out
    assert "Greedy outputs identical to plain generate: YES" in out
    assert "TriForceConfig(draft='ngram', retrieval_budget=64)" in out
    greedy = out.split("Greedy:\n")[1].split("\n\n")[0].splitlines()
    assert [row.split(" | ")[0] for row in greedy[2:]] == ["| plain", "| static", "| triforce"]
    assert all(row.endswith("| yes |") for row in greedy[2:]), greedy
