"""The attention route of CPU calls over a long cache, chosen by timing (`hf_triforce.kernels.attention_routes`).

* a call's set-up times every class its calls reach (new-row counts 1/2/4/8 and power-of-two cache lengths from
  `cpu_attention.MIN_CACHED` up to the call's length), before any forward, once per model: a second call times
  nothing;
* the choice follows the timing: a kernel made slow loses to ATen's route and an ATen route made slow loses to the
  kernel; where the kernel was timed slower it never runs (and greedy output stays plain ``generate``'s); a mixed
  table sends each class its own way; outside a TriForce call's set-up the kernel never runs;
* the kernels are built at the call's set-up, before any forward; the stats and the bench table's heading say what
  ran: the build target, each kernel's status (a linear kernel that is off says so), the attention routes.
"""

from __future__ import annotations

import time

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.decoding import force3
from hf_triforce.kernels import attention, attention_routes, cpu_attention, few_rows_linear, native_build
from hf_triforce_bench import compare as bench

from .conftest import make_model, random_prompt
from .test_cpu_attention import _case, needs_kernel
from .test_greedy_identity import assert_identical

CONFIG = TriForceConfig(draft="ngram", levels=2, policy="fixed", gamma2=4)


def _long_model():
    """Head dim 64 (the kernel's), one KV head of two query heads: its calls over a 1100-token prompt are the
    kernel's."""
    return make_model("llama-gqa", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=4096)


def _identical_counting_from_triforce(model, prompt, config, forwards: list, max_new_tokens: int, *cleared: list):
    """`assert_identical`, with ``forwards`` and ``cleared`` emptied between plain ``generate`` and TriForce's call.
    """
    expected = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    for counts in (forwards, *cleared):
        counts.clear()
    out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    return out.triforce_stats


def _count_prefills(monkeypatch, prefills: list) -> None:
    """Append to ``prefills`` at each prompt prefill of Force 3 (`forwards.forward.prefill`)."""
    real = force3.prefill
    monkeypatch.setattr(force3, "prefill", lambda *args, **kwargs: prefills.append(1) or real(*args, **kwargs))


def test_classes():
    assert [attention_routes.row_class(n) for n in (1, 2, 3, 4, 7, 8, 11)] == [1, 2, 2, 4, 4, 8, 8]
    assert [attention_routes.length_class(n) for n in (1024, 2047, 2048, 5000, 40000)] == \
        [1024, 1024, 2048, 4096, 32768]


@needs_kernel
def test_routes_are_timed_at_set_up_once_per_model(monkeypatch):
    model = _long_model()
    prompt = random_prompt(cpu_attention.MIN_CACHED + 1100, period=61)  # two cache lengths: 1024 and 2048
    timed, prefills = [], []
    real = attention_routes.AttentionRoutes.calibrate

    def calibrate(self, shape, rows, length):
        timed.append((rows, length, len(prefills)))
        return real(self, shape, rows, length)

    monkeypatch.setattr(attention_routes.AttentionRoutes, "calibrate", calibrate)
    _count_prefills(monkeypatch, prefills)
    stats = _identical_counting_from_triforce(model, prompt, CONFIG, prefills, 8, timed)
    assert sorted((rows, length) for rows, length, _ in timed) == \
        sorted((rows, length) for rows in (1, 2, 4, 8) for length in (1024, 2048))
    assert prefills and all(ran == 0 for _, _, ran in timed)  # before the prefill, so before every decoding step
    assert stats.detail.attention_calibration_seconds > 0
    table = next(iter(stats.detail.attention_routes.values()))
    assert set(table) == {1, 2, 4, 8} and all(set(by_length) == {1024, 2048} for by_length in table.values())
    again = assert_identical(model, prompt, CONFIG, max_new_tokens=8)
    assert len(timed) == 8 and again.detail.attention_calibration_seconds == 0  # kept for the model
    assert again.detail.attention_routes == stats.detail.attention_routes


def _slowed(run, seconds: float):
    def slow(*args):
        time.sleep(seconds)
        return run(*args)

    return slow


@needs_kernel
def test_the_faster_route_is_chosen():
    """Timed, not assumed: slowing one route by 20 ms makes the other win."""
    routes = attention_routes.AttentionRoutes()
    shape = (torch.float32, 64, 3, 3, torch.get_num_threads())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_attention, "attend", _slowed(cpu_attention.attend, 0.02))
        assert routes.calibrate(shape, 4, 1024) == "aten"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "aten_attention", _slowed(attention.aten_attention, 0.02))
        assert routes.calibrate(shape, 4, 1024) == "kernel"


@needs_kernel
def test_aten_route_matches_the_reference():
    for new in (1, 5):
        query, key, value = _case(64, 3, 3, new, 1500)
        got = attention.aten_attention(query, key, value, None)
        assert (got.double() - cpu_attention.reference(query, key, value, None)).abs().max().item() < 1e-5


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *args: calls.append(args[0].shape[2]) or attend(*args))
    return calls


@needs_kernel
def test_a_kernel_timed_slower_never_runs(monkeypatch):
    monkeypatch.setattr(attention_routes.AttentionRoutes, "calibrate", lambda self, shape, rows, length: "aten")
    calls = _counting(monkeypatch)
    stats = assert_identical(_long_model(), random_prompt(cpu_attention.MIN_CACHED + 80, period=61), CONFIG,
                             max_new_tokens=24)
    assert calls == []
    assert stats.detail.attention_kernel == "sdpa (cpu kernel slower at all 4 timed classes)"
    assert stats.force3_steps > 0


@needs_kernel
def test_each_class_takes_its_own_route(monkeypatch):
    """One-row steps timed cheaper on the kernel, verifications on ATen's: only one-row calls reach the kernel."""
    monkeypatch.setattr(attention_routes.AttentionRoutes, "calibrate",
                        lambda self, shape, rows, length: "kernel" if rows == 1 else "aten")
    calls = _counting(monkeypatch)
    stats = assert_identical(_long_model(), random_prompt(cpu_attention.MIN_CACHED + 80, period=61), CONFIG,
                             max_new_tokens=24)
    assert calls and set(calls) == {1}
    assert stats.detail.attention_kernel == "cpu kernel where faster (1 of 4 timed classes, sdpa elsewhere)"


@needs_kernel
def test_outside_a_call_set_up_the_kernel_does_not_run():
    query, key, value = _case(64, 3, 3, 2, 1100)
    assert cpu_attention.supports(query, key, value) and attention_routes.active() is None
    assert not attention_routes.takes_kernel(query, key, value)
    routes = attention_routes.AttentionRoutes()
    routes.calibrate = lambda shape, rows, length: "kernel"
    with routes.installed(make_model(), 2048):
        assert attention_routes.takes_kernel(query, key, value)
    assert attention_routes.active() is None


@needs_kernel
def test_kernels_are_built_at_set_up_and_reported(monkeypatch):
    """The kernels are built before the call's first forward (a compile never lands in a timed step), and the
    stats and the bench table's heading name the build target and each kernel's status: a linear kernel that is off
    says so (its routes then time ATen's only)."""
    prefills: list[int] = []
    loaded: list[int] = []
    real_attention = cpu_attention._load
    monkeypatch.setattr(cpu_attention, "_load", lambda: loaded.append(len(prefills)) or real_attention())
    monkeypatch.setattr(few_rows_linear, "_load", lambda: (None, "off (HF_TRIFORCE_CPU_LINEAR=off)"))
    _count_prefills(monkeypatch, prefills)
    model = make_model("llama-gqa")
    stats = _identical_counting_from_triforce(model, random_prompt(150, period=37), CONFIG, prefills, 12, loaded)
    assert prefills and loaded and loaded[0] == 0  # built before the prefill, so before every decoding step
    off = "off (HF_TRIFORCE_CPU_LINEAR=off)"
    assert stats.detail.cpu_kernels == {"target": native_build.build_target(), "attention": "on", "linear": off}
    assert "stream" not in str(stats.detail.linear_routes)  # the linear kernel off: no route of it was timed
    assert stats.detail.attention_kernel.startswith("sdpa (head dim 8")  # the tiny model's heads: not the kernel's
    note = bench.kernels_note([bench.Run("triforce", stats=stats)])
    assert f"built for {native_build.build_target()}" in note and f"linear kernel {off}" in note
    assert "attention sdpa (head dim 8" in note and "decoder 1:" in note
