"""The CPU kernels' shared build and load (`kernels.native_build`): each kernel's environment switch turns it off, and
a build that fails leaves the kernel off with the reason in its `status`, for every kernel built this way."""

from __future__ import annotations

import shutil

import pytest

from hf_triforce.kernels import cpu_attention, few_rows_linear

from .test_cpu_attention import needs_kernel

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
