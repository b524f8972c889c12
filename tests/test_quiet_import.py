"""`import hf_triforce` and `hf-triforce ... --help` print nothing unasked and load no optional stack.

Run in fresh interpreters (this process has long imported transformers' models, and with them torchao):
with the deploy extra installed, importing ``transformers.modeling_utils`` imports torchao, which prints
"Failed to load ..._C_mxfp8...so" lines and torch pytree deprecation warnings and costs seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hf_triforce

# Optional stacks (extras) and the transformers module that imports every installed quantization stack.
OPTIONAL = ("torchao", "peft", "bitsandbytes", "llama_cpp", "matplotlib", "gguf", "transformers.modeling_utils")
COMMANDS = ("demo", "generate", "serve")
BENCH_COMMANDS = ("decode", "needle", "project")  # hf-triforce-bench (hf_triforce_bench.cli)


def _environment() -> dict[str, str]:
    """This checkout's package first on the path (the one under test, not another install)."""
    root = str(Path(hf_triforce.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run the commands concurrently (each pays torch's and transformers' imports)."""
    env = _environment()
    started = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for name, argv in commands.items()}
    results = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return results


def _help_command(module: str, commands: tuple[str, ...], loaded: str) -> list[str]:
    """A fresh interpreter printing ``module``'s ``main --help`` and each command's ``--help``, then checking that no
    optional stack was loaded."""
    helps = "; ".join(f"_help({argv!r})" for argv in [["--help"], *([command, "--help"] for command in commands)])
    return [sys.executable, "-c", f"import sys\nfrom {module} import main\n"
            "def _help(argv):\n    try:\n        main(argv)\n    except SystemExit as e:\n"
            f"        assert e.code == 0, e.code\n{helps}\n{loaded}"]


def test_import_and_help_print_nothing_unasked():
    loaded = f"bad = [m for m in {OPTIONAL!r} if m in sys.modules]; bad and sys.exit(f'loaded {{bad}}')"
    results = _run_all({
        # nothing on stdout or stderr; a loaded optional stack exits with its name on stderr
        "import hf_triforce": [sys.executable, "-c", f"import sys, hf_triforce; {loaded}"],
        # hf-triforce --help and each subcommand's --help (the console script calls hf_triforce.tools.cli:main), and
        # hf-triforce-bench's (hf_triforce_bench.cli:main)
        "--help": _help_command("hf_triforce.tools.cli", COMMANDS, loaded),
        "bench --help": _help_command("hf_triforce_bench.cli", BENCH_COMMANDS, loaded),
    })
    for name, result in results.items():
        assert result.returncode == 0 and result.stderr == "", (name, result.returncode, result.stderr)
    assert results["import hf_triforce"].stdout == ""
    for name, program, commands in (("--help", "hf-triforce", COMMANDS),
                                    ("bench --help", "hf-triforce-bench", BENCH_COMMANDS)):
        pages = results[name].stdout.split(f"usage: {program} ")
        assert pages[0] == "" and [page.split()[0] for page in pages[1:]] == ["[-h]", *commands], name
