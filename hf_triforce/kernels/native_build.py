"""Building and loading the library's C kernels (`csrc/`): compiled on first use, kept, loaded into torch's OpenMP.

Each kernel is compiled with the system's C compiler for the CPU it runs on (``-march=native``; 512-bit vectors where
the CPU has AVX-512, gcc's default for ``-march=native`` often being 256), kept under ``$HF_TRIFORCE_CACHE/kernels``
(default ``~/.cache/hf_triforce/kernels``) by source, compiler and CPU flags, and loaded with ctypes into torch's
OpenMP runtime (the library names ``libgomp.so.1``, already loaded by torch). x86-64 Linux only; elsewhere
`unsupported_platform` says why not, and each kernel's module keeps ATen's paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
LIBRARIES = ("-lmvec", "-lm")
OFF_VALUES = ("0", "off", "false", "no")  # an environment switch's values that turn a kernel off
Kernel = TypeVar("Kernel")


def cache_dir() -> Path:
    from ..tools.assets import cache_root  # the library's one cache folder ($HF_TRIFORCE_CACHE)

    return cache_root() / "kernels"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def vector_flags() -> tuple[str, ...]:
    """512-bit vectors where the CPU has AVX-512."""
    return ("-mprefer-vector-width=512",) if " avx512f" in cpu_flags() else ()


def unsupported_platform() -> str | None:
    """Why no kernel is built on this platform, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not built for {platform.system()} {platform.machine()} (x86-64 Linux only)"
    return None


def build(name: str, sources: tuple[Path, ...]) -> Path:
    """The shared library of ``sources`` (the first compiled, the rest included by it), built now if not kept yet.
    Raises RuntimeError with the compiler's error."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = (*FLAGS, *vector_flags())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = (*(path.read_text() for path in sources), compiler, version, *flags, cpu_flags())
    key = hashlib.sha256("\0".join(parts).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        run = subprocess.run([compiler, *flags, str(sources[0]), "-o", str(built), *LIBRARIES], capture_output=True,
                             text=True)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-400:]}")
        os.replace(built, target)
    return target


def load(name: str, sources: tuple[Path, ...]) -> ctypes.CDLL:
    """`build` then load ``name``'s library (RuntimeError / OSError / SubprocessError on failure)."""
    return ctypes.CDLL(str(build(name, sources)))


def switched_off(env: str) -> str | None:
    """Why the kernel switched by environment variable ``env`` is off, or None."""
    if os.environ.get(env, "").lower() in OFF_VALUES:
        return f"off ({env}={os.environ[env]})"
    return None


def load_checked(env: str, name: str, sources: tuple[Path, ...], wrap: Callable[[ctypes.CDLL], Kernel],
                 self_check: Callable[[Kernel], str | None]) -> tuple[Kernel | None, str]:
    """The kernel ``name`` built, loaded, wrapped and checked, and "on"; or None and why not: switched off by ``env``,
    an unsupported platform, a failed build or load, or ``self_check``'s complaint (a message; None: passed)."""
    why = switched_off(env) or unsupported_platform()
    if why is not None:
        return None, why
    try:
        kernel = wrap(load(name, sources))
        error = self_check(kernel)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"unavailable ({type(exc).__name__}: {exc})"
    if error is not None:
        return None, f"unavailable (self-check against float64: {error})"
    return kernel, "on"
