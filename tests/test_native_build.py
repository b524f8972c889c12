"""The CPU kernels' shared build and load (`kernels.native_build`): each kernel's environment switch turns it off, and
a build that fails leaves the kernel off with the reason in its `status`, for every kernel built this way; a kept
library that is damaged is rebuilt (or refused with the reason where no compiler is there) and never loaded; a kept
one loads without a compiler; a compiler that hangs is stopped; a long compile shows progress; the build target
(``HF_TRIFORCE_CPU_MARCH``) enters the flags and the cache key, and one the CPU cannot run is refused; the code each
target builds (AVX2's 8 lanes, AVX-512's 16 without AVX512-BF16) computes within the kernels' bounds in every dtype."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from hf_triforce.kernels import cpu_attention, few_rows_linear, gguf_linear, native_build

from .test_cpu_attention import build_label, needs_kernel

KERNELS = pytest.mark.parametrize("kernel_module", [cpu_attention, few_rows_linear], ids=lambda m: m.__name__)


@KERNELS
def test_off_switch(monkeypatch, kernel_module):
    monkeypatch.setenv(kernel_module.ENV, "off")
    kernel, why = kernel_module._load.__wrapped__()
    assert kernel is None and why == f"off ({kernel_module.ENV}=off)"


@needs_kernel
@KERNELS
def test_failed_build_says_why(monkeypatch, tmp_path, kernel_module):
    monkeypatch.setenv("HF_TRIFORCE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    kernel, why = kernel_module._load.__wrapped__()
    assert kernel is None and why.startswith("unavailable (") and "false" in why


def _fresh(monkeypatch, tmp_path):
    """An empty kernel cache under ``tmp_path``."""
    monkeypatch.setenv("HF_TRIFORCE_CACHE", str(tmp_path / "cache"))


def _no_compiler(monkeypatch, tmp_path):
    """No C compiler to be found: no ``$CC``, a PATH of an empty folder."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    assert native_build.compiler() is None


@needs_kernel
def test_a_damaged_kept_library_is_rebuilt(monkeypatch, tmp_path):
    """A kept library truncated to 1,000 bytes (loading it would end the process with a bus error) is found damaged
    by its record and rebuilt, with a warning saying why."""
    _fresh(monkeypatch, tmp_path)
    built = native_build.build("few_rows_linear", few_rows_linear.SOURCES)
    size = built.stat().st_size
    with open(built, "r+b") as handle:
        handle.truncate(1000)
    assert native_build.damage(built) == f"damaged (1000 bytes, built {size})"
    with pytest.warns(RuntimeWarning, match="damaged"):
        again = native_build.build("few_rows_linear", few_rows_linear.SOURCES)
    assert again == built and again.stat().st_size == size and native_build.damage(again) is None
    kernel, why = few_rows_linear._load.__wrapped__()
    assert why == "on" and kernel is not None


@needs_kernel
def test_a_changed_byte_is_found_by_the_digest(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    built = native_build.build("few_rows_linear", few_rows_linear.SOURCES)
    data = bytearray(built.read_bytes())
    data[len(data) // 2] ^= 0xFF
    built.write_bytes(bytes(data))
    assert native_build.damage(built) == "damaged (its SHA-256 differs from its record's)"


@needs_kernel
@KERNELS
def test_a_kept_library_loads_without_a_compiler(monkeypatch, tmp_path, kernel_module):
    """A cache prepared where a compiler is (an image's build stage) serves where there is none."""
    _fresh(monkeypatch, tmp_path)
    assert kernel_module._load.__wrapped__()[1] == "on"
    _no_compiler(monkeypatch, tmp_path)
    kernel, why = kernel_module._load.__wrapped__()
    assert why == "on" and kernel is not None


@needs_kernel
def test_a_damaged_library_without_a_compiler_is_refused_with_the_reason(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    built = native_build.build("few_rows_linear", few_rows_linear.SOURCES)
    with open(built, "r+b") as handle:
        handle.truncate(1000)
    _no_compiler(monkeypatch, tmp_path)
    kernel, why = few_rows_linear._load.__wrapped__()
    assert kernel is None
    assert why.startswith("unavailable (RuntimeError: no C compiler") and "damaged (1000 bytes" in why
    built.with_suffix(".json").unlink()  # a library without its record is not loaded either
    assert "without a valid record" in few_rows_linear._load.__wrapped__()[1]


def _slow_compiler(tmp_path, seconds: float) -> str:
    """A ``cc`` that answers ``--version`` at once and compiles after ``seconds``."""
    script = tmp_path / "slow-cc"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exec cc --version\nsleep {seconds}\nexec cc \"$@\"\n")
    script.chmod(0o755)
    return str(script)


@needs_kernel
def test_a_compiler_that_hangs_is_stopped(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", _slow_compiler(tmp_path, 30))
    monkeypatch.setattr(native_build, "COMPILE_TIMEOUT_S", 0.5)
    began = time.perf_counter()
    kernel, why = few_rows_linear._load.__wrapped__()
    assert kernel is None and why == "unavailable (the compiler ran past 0.5 s)"
    assert time.perf_counter() - began < 10


@needs_kernel
def test_a_compile_longer_than_a_second_shows_progress(monkeypatch, tmp_path, capsys):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", _slow_compiler(tmp_path, 1.6))
    assert few_rows_linear._load.__wrapped__()[1] == "on"
    assert "compiling few_rows_linear" in capsys.readouterr().err


def _answering_compiler(path, version: str) -> str:
    """A ``cc`` at ``path`` whose ``--version`` prints ``version`` (it compiles nothing)."""
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


def test_the_compiler_enters_the_cache_key(monkeypatch, tmp_path):
    """The kept library is the compiler's: another ``$CC`` (another path, the same ``--version``) or the same path
    answering another ``--version`` (an upgraded compiler) has its own key; the same compiler keeps its key."""
    _fresh(monkeypatch, tmp_path)
    paths = []
    for name, version in (("cc-a", "cc 1.0"), ("cc-b", "cc 1.0"), ("cc-b", "cc 2.0")):
        monkeypatch.setenv("CC", _answering_compiler(tmp_path / name, version))
        paths.append(native_build.kept_path("few_rows_linear", few_rows_linear.SOURCES))
        assert native_build.kept_path("few_rows_linear", few_rows_linear.SOURCES) == paths[-1]
    assert len(set(paths)) == 3


@needs_kernel
def test_a_library_another_compiler_built_is_rebuilt_and_serves_where_no_compiler_is(monkeypatch, tmp_path):
    """A library kept from one compiler is not loaded under another (it builds its own); where no compiler is found,
    a kept one of the same sources, flags and CPU loads whichever compiler built it."""
    _fresh(monkeypatch, tmp_path)
    cc = native_build.compiler()
    monkeypatch.setenv("CC", _tuned_compiler(tmp_path, cc, "generic"))
    first = native_build.build("few_rows_linear", few_rows_linear.SOURCES)
    monkeypatch.setenv("CC", cc)
    second = native_build.build("few_rows_linear", few_rows_linear.SOURCES)
    assert first != second and native_build.damage(first) is None and native_build.damage(second) is None
    _no_compiler(monkeypatch, tmp_path)
    assert native_build.kept_path("few_rows_linear", few_rows_linear.SOURCES) in (first, second)
    kernel, why = few_rows_linear._load.__wrapped__()
    assert why == "on" and kernel is not None


def test_build_target_switch(monkeypatch):
    """``HF_TRIFORCE_CPU_MARCH`` picks the ``-march`` (and the vector width with it) and enters the cache key; any
    other value is an error naming the allowed ones."""
    monkeypatch.setattr(native_build, "cpu_features", lambda: frozenset(native_build.MARCHES["x86-64-v4"]))
    paths = {}
    for march, wide in (("native", True), ("x86-64-v4", True), ("x86-64-v3", False)):
        monkeypatch.setenv(native_build.MARCH_ENV, march)
        flags = native_build.compile_flags()
        assert f"-march={march}" in flags and ("-mprefer-vector-width=512" in flags) == wide
        assert native_build.unsupported_target() is None
        paths[march] = native_build.kept_path("few_rows_linear", few_rows_linear.SOURCES)
    assert len(set(paths.values())) == 3
    monkeypatch.setenv(native_build.MARCH_ENV, "skylake")
    with pytest.raises(ValueError, match="HF_TRIFORCE_CPU_MARCH='skylake' .* native, x86-64-v3, x86-64-v4"):
        native_build.compile_flags()
    with pytest.raises(ValueError, match="HF_TRIFORCE_CPU_MARCH"):
        few_rows_linear._load.__wrapped__()


def test_a_target_the_cpu_cannot_run_is_refused(monkeypatch):
    """x86-64-v4 on an AVX2 CPU would stop the process at the first AVX-512 instruction: refused, naming what the
    CPU lacks."""
    monkeypatch.setattr(native_build, "cpu_features", lambda: frozenset(native_build.MARCHES["x86-64-v3"]))
    monkeypatch.setattr(native_build, "unsupported_platform", lambda: None)
    monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v4")
    assert native_build.unsupported_target() == \
        "HF_TRIFORCE_CPU_MARCH=x86-64-v4: this CPU lacks avx512f, avx512bw, avx512cd, avx512dq, avx512vl"
    kernel, why = few_rows_linear._load.__wrapped__()
    assert kernel is None and why == f"unavailable ({native_build.unsupported_target()})"
    monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v3")
    assert native_build.unsupported_target() is None
    assert "-mprefer-vector-width=512" not in native_build.compile_flags()  # native on an AVX2 CPU: 256-bit
    monkeypatch.setenv(native_build.MARCH_ENV, "native")
    assert "-mprefer-vector-width=512" not in native_build.compile_flags()


def test_without_cpuinfo_the_key_carries_torchs_isa_level(monkeypatch):
    """Where /proc/cpuinfo cannot be read, ``native`` builds for the ISA level torch detects, and that level enters
    the cache key: a build for an AVX-512 CPU is not loaded on an AVX2 one."""
    monkeypatch.setattr(native_build, "cpu_features", lambda: None)
    monkeypatch.delenv(native_build.MARCH_ENV, raising=False)
    paths = {}
    for capability, march in (("AVX512", "x86-64-v4"), ("AVX2", "x86-64-v3")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert native_build.build_target() == march and f"-march={march}" in native_build.compile_flags()
        assert capability in native_build.cpu_signature()
        paths[capability] = native_build.kept_path("few_rows_linear", few_rows_linear.SOURCES)
    assert paths["AVX512"] != paths["AVX2"]
    monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v4")  # a forced level above torch's: refused
    assert "ISA level is AVX2" in native_build.unsupported_target()


@needs_kernel
@KERNELS
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
def test_each_build_target_builds_and_passes_its_check(monkeypatch, tmp_path, kernel_module, march):
    """The AVX2 build (what an AVX2-only CPU runs: 8-lane vectors) is built and checked against float64 on any newer
    CPU; the AVX-512 one (16 lanes, bf16 widened in registers where AVX512-BF16 is not assumed) where the CPU has
    AVX-512, else refused with what it lacks (the whole suite runs on either target under ``HF_TRIFORCE_CPU_MARCH``).
    A built one also keeps a ragged call per dtype within the bounds the native build's tests hold."""
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv(native_build.MARCH_ENV, march)
    kernel, why = kernel_module._load.__wrapped__()
    lacking = native_build.unsupported_target()
    assert (kernel is not None and why == "on") if lacking is None else why == f"unavailable ({lacking})"
    assert march == "x86-64-v4" or lacking is None  # every x86-64 Linux CPU this suite runs on has AVX2
    if kernel is not None:
        records = list(native_build.cache_dir().glob("*.json"))
        assert len(records) == 1 and f"-march={march}" in json.loads(records[0].read_text())["flags"]
        _within_bounds(kernel_module, kernel)


def _within_bounds(kernel_module, kernel) -> None:
    """``kernel`` (of ``kernel_module``) on a ragged call per dtype, against float64 within the module's bound."""
    generator = torch.Generator().manual_seed(4)
    for dtype in kernel_module.DTYPES:
        if kernel_module is few_rows_linear:
            x, weight = (torch.randn(n, 77, generator=generator).to(dtype) for n in (11, 43))
            error = (few_rows_linear._multiply_with(kernel, x, weight).double() - x.double() @ weight.double().T).abs()
            assert bool((error <= few_rows_linear.error_bound(x, weight)).all()), (dtype, error.max().item())
            continue
        for dim, kv_heads, groups, new in ((64, 3, 3, 5), (128, 2, 3, 1)):
            buffers = torch.randn(2, 1, kv_heads, 1150, dim, generator=generator).to(dtype)
            key, value = buffers[0, :, :, :1111], buffers[1, :, :, :1111]
            query = torch.randn(1, kv_heads * groups, new, dim, generator=generator).to(dtype)
            expected = cpu_attention.reference(query, key, value, None)
            error = (cpu_attention._attend_with(kernel, query, key, value).double() - expected).abs()
            assert bool((error <= cpu_attention.tolerance(expected, dtype)).all()), (dtype, dim, error.max().item())


def _tuned_compiler(tmp_path, cc: str, tune: str) -> str:
    """A compiler that compiles as ``cc`` does, tuned for ``tune`` (``-mtune``: the same instructions, other choices
    of which to use)."""
    script = tmp_path / f"cc-{tune}"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exec {cc} --version\nexec {cc} \"$@\" -mtune={tune}\n")
    script.chmod(0o755)
    return str(script)


def _products(kernel_module, kernel) -> list[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    """Per input dtype or block type: the kernel's product of 11 rows (a pass of 8 and one of 3), each row's alone."""
    generator = torch.Generator().manual_seed(8)
    if kernel_module is few_rows_linear:
        cases = [(str(dtype), torch.randn(11, 577, generator=generator).to(dtype),
                  torch.randn(300, 577, generator=generator).to(dtype)) for dtype in few_rows_linear.DTYPES]
    else:
        cases = [(kind, torch.randn(11, 3 * gguf_linear.TYPES[kind][2], generator=generator),
                  gguf_linear.random_matrix(kind, 300, 3 * gguf_linear.TYPES[kind][2], generator))
                 for kind in ("Q4_1", "Q6_K")]
    return [(label, kernel_module._multiply_with(kernel, x, weight),
             [kernel_module._multiply_with(kernel, x[r : r + 1], weight)[0] for r in range(len(x))])
            for label, x, weight in cases]


@needs_kernel
@pytest.mark.parametrize("kernel_module", [few_rows_linear, gguf_linear], ids=lambda m: m.__name__)
def test_a_compilers_tuning_changes_no_rounding(monkeypatch, tmp_path, kernel_module):
    """The linear kernels round as their source says on any build: tuned for other CPUs (gcc's znver tunings leave
    256-bit multiply-add chains unfused where the compiler may choose), a build gives this one's outputs bit for bit,
    and each row alone its several-row pass's."""
    expected = _products(kernel_module, kernel_module._load()[0])
    cc = native_build.compiler()
    for tune in ("generic", "znver2"):
        _fresh(monkeypatch, tmp_path / tune)
        monkeypatch.setenv("CC", _tuned_compiler(tmp_path, cc, tune))
        kernel, why = kernel_module._load.__wrapped__()
        assert why == "on", (tune, why)
        for (label, whole, alone), (_, want, _) in zip(_products(kernel_module, kernel), expected):
            for r, row in enumerate(alone):
                assert torch.equal(row, whole[r]), (f"-mtune={tune}", label, f"row {r} alone", build_label())
            assert torch.equal(whole, want), (f"-mtune={tune}", label, "another rounding than the default build's",
                                              build_label())
