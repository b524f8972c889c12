"""Building and loading the library's C kernels (`csrc/`): compiled on first use, kept, loaded into torch's OpenMP
(docs/deployment.md, "Build").

Build target: ``HF_TRIFORCE_CPU_MARCH`` (`MARCHES`): ``native`` (the default; 512-bit vectors where the CPU has
AVX-512), ``x86-64-v4`` or ``x86-64-v3`` (the code an AVX2-only CPU runs, built and checked on any newer one). A
forced target the CPU cannot run is refused with the features it lacks (`unsupported_target`). Where
``/proc/cpuinfo`` cannot be read, ``native`` builds for the ISA level torch detects (`CAPABILITY_TARGETS`), so the
cache key always names the instructions the build may use.

Each kernel is kept under ``$HF_TRIFORCE_CACHE/kernels`` as ``<name>-<key>-<compiler key>.so`` (`kept_path`: the key
a digest of its sources, flags and the CPU's features; the compiler key one of `compiler_identity`), beside a
``.json`` record of its size and SHA-256. A kept library is loaded only where it matches its record (`damage`); with
no compiler, a kept library of the same key built by any compiler is loaded. The compiler runs under
`COMPILE_TIMEOUT_S`; callers build at a call's set-up, not inside a timed step. x86-64 Linux only
(`unsupported_platform`); elsewhere each kernel's module keeps ATen's paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from tqdm.auto import tqdm

CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=off: a product and a sum are fused only where the source says so (csrc/vectors.h, `fmadd`), so a
# kernel rounds alike on every build target and tuning
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")
LIBRARIES = ("-lmvec", "-lm")
OFF_VALUES = ("0", "off", "false", "no")  # an environment switch's values that turn a kernel off
MARCH_ENV = "HF_TRIFORCE_CPU_MARCH"
X86_64_V3 = ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm")  # /proc/cpuinfo's names of the level
# the build targets HF_TRIFORCE_CPU_MARCH takes, and the CPU features (as /proc/cpuinfo names them) each needs
MARCHES = {
    "native": (),
    "x86-64-v3": X86_64_V3,
    "x86-64-v4": (*X86_64_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
# torch's ISA level (`torch.backends.cpu.get_cpu_capability`) -> the target ``native`` means without /proc/cpuinfo
CAPABILITY_TARGETS = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}
COMPILE_TIMEOUT_S = 300.0  # a compile of one kernel takes 1-5 s; a compiler that hangs is stopped, the kernel off
PROGRESS_AFTER_S = 1.0  # a compile longer than this shows a progress line
Kernel = TypeVar("Kernel")
POINTER, LONG, INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int  # the C types of the kernels' arguments


def cache_dir() -> Path:
    from ..assets import cache_root  # the library's one cache folder ($HF_TRIFORCE_CACHE)

    return cache_root() / "kernels"


def cpu_features() -> frozenset[str] | None:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them, or None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def requested_march() -> str:
    """``HF_TRIFORCE_CPU_MARCH`` (default ``native``); ValueError naming the allowed values for any other."""
    value = os.environ.get(MARCH_ENV, "native") or "native"
    if value not in MARCHES:
        raise ValueError(f"{MARCH_ENV}={value!r} is not a build target: one of {', '.join(MARCHES)}")
    return value


def build_target() -> str:
    """The ``-march`` the kernels are built for: `requested_march`, ``native`` resolved to torch's ISA level where
    ``/proc/cpuinfo`` cannot be read (`CAPABILITY_TARGETS`; ``native`` kept where torch names no such level)."""
    march = requested_march()
    if march == "native" and cpu_features() is None:
        return CAPABILITY_TARGETS.get(torch.backends.cpu.get_cpu_capability(), march)
    return march


def unsupported_target() -> str | None:
    """Why this CPU cannot run the `build_target`'s instructions (the features it lacks), or None."""
    march = build_target()
    features = cpu_features()
    if march == "native":
        return None if features is not None else "no CPU features known (no /proc/cpuinfo, no ISA level from torch)"
    if features is None:  # the level torch detected: what the target needs, or a lower one
        capability = torch.backends.cpu.get_cpu_capability()
        levels = list(CAPABILITY_TARGETS.values())
        have = CAPABILITY_TARGETS.get(capability)
        if have is None or levels.index(have) > levels.index(march):
            return f"{MARCH_ENV}={march}: this CPU's ISA level is {capability} (torch)"
        return None
    missing = [feature for feature in MARCHES[march] if feature not in features]
    return f"{MARCH_ENV}={march}: this CPU lacks {', '.join(missing)}" if missing else None


def compile_flags() -> tuple[str, ...]:
    """The compiler's flags for the `build_target`: 512-bit vectors where it has AVX-512."""
    march = build_target()
    wide = march == "x86-64-v4" or (march == "native" and "avx512f" in (cpu_features() or ()))
    return (*FLAGS, f"-march={march}", *(("-mprefer-vector-width=512",) if wide else ()))


def cpu_signature() -> str:
    """What the CPU contributes to the cache key: its feature flags, or torch's ISA level where they are unknown."""
    features = cpu_features()
    if features is not None:
        return " ".join(sorted(features))
    return f"capability {torch.backends.cpu.get_cpu_capability()}"


def unsupported_platform() -> str | None:
    """Why no kernel is built on this platform, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not built for {platform.system()} {platform.machine()} (x86-64 Linux only)"
    return None


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compiler_identity(cc: str) -> str:
    """What compiler ``cc`` contributes to the cache key: its path (resolved on PATH) and its ``--version`` output
    (OSError where it cannot be run, subprocess.TimeoutExpired past `COMPILE_TIMEOUT_S`)."""
    version = _run_compiler([cc, "--version"], f"{cc} --version")
    return "\0".join((shutil.which(cc) or cc, version.stdout.strip(), version.stderr.strip()))


def kept_path(name: str, sources: tuple[Path, ...]) -> Path:
    """Where ``name``'s library built from ``sources`` for this CPU and target by this compiler (`compiler`) is kept
    (whether or not it is there). With no compiler: the kept library of the same sources, flags and CPU that another
    compiler built (an intact one first, then the newest; `damage`), or where there is none a path that is absent."""
    parts = (*(path.read_text() for path in sources), *compile_flags(), *LIBRARIES, cpu_signature())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cc = compiler()
    if cc is not None:
        return cache_dir() / f"{name}-{key}-{hashlib.sha256(compiler_identity(cc).encode()).hexdigest()[:12]}.so"
    kept = sorted(cache_dir().glob(f"{name}-{key}-*.so"), key=lambda path: (damage(path) is None, path.stat().st_mtime))
    return kept[-1] if kept else cache_dir() / f"{name}-{key}-nocompiler.so"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def damage(library: Path) -> str | None:
    """Why the kept ``library`` cannot be loaded: absent, no record beside it, or its size or SHA-256 other than its
    record's; None where it is intact."""
    record_path = library.with_suffix(".json")
    if not library.exists():
        return "absent"
    try:
        record = json.loads(record_path.read_text())
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"without a valid record ({record_path.name}: {type(exc).__name__})"
    actual = library.stat().st_size
    if actual != size:
        return f"damaged ({actual} bytes, built {size})"
    if _digest(library) != digest:
        return "damaged (its SHA-256 differs from its record's)"
    return None


def _run_compiler(command: list[str], label: str) -> subprocess.CompletedProcess:
    """Run ``command`` under `COMPILE_TIMEOUT_S`, a progress line once it has taken `PROGRESS_AFTER_S`; interruptible
    (the compiler is stopped). TimeoutExpired past the limit."""
    began = time.perf_counter()
    # its own process group: a stop reaches the compiler's children (cc1, as, ld), which hold its output pipes
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        with tqdm(desc=f"compiling {label}", unit="s", delay=PROGRESS_AFTER_S, leave=False,
                  bar_format="{desc}: {elapsed}") as bar:
            while True:
                try:
                    stdout, stderr = process.communicate(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if time.perf_counter() - began > COMPILE_TIMEOUT_S:
                        raise subprocess.TimeoutExpired(command, COMPILE_TIMEOUT_S) from None
                    bar.update(0)
    finally:
        if process.poll() is None:  # timed out or interrupted
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def build(name: str, sources: tuple[Path, ...]) -> Path:
    """The shared library of ``sources`` (the first compiled, the rest included by it): the kept one where intact
    (`damage`), else built now. Raises RuntimeError with the compiler's error, or where there is no compiler to build
    it (saying what became of the kept one), and subprocess.TimeoutExpired past `COMPILE_TIMEOUT_S`."""
    target = kept_path(name, sources)
    problem = damage(target)
    if problem is None:
        return target
    cc = compiler()
    if cc is None:
        kept = "" if problem == "absent" else f"; the kept {target.name} is {problem}"
        raise RuntimeError(f"no C compiler (cc or gcc) on PATH to build {name}{kept}")
    if problem != "absent":
        warnings.warn(f"rebuilding the CPU kernel {name}: the kept {target} is {problem}", RuntimeWarning,
                      stacklevel=2)
    flags = compile_flags()
    version = _run_compiler([cc, "--version"], f"{name} ({cc} --version)").stdout.strip()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        run = _run_compiler([cc, *flags, str(sources[0]), "-o", str(built), *LIBRARIES],
                            f"{name} ({cc} {' '.join(flags)})")
        if run.returncode:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[-400:]}")
        record = Path(tmp) / "record.json"
        record.write_text(json.dumps({"size": built.stat().st_size, "sha256": _digest(built), "compiler": cc,
                                      "compiler_version": version.splitlines()[0] if version else "",
                                      "flags": list(flags)}, indent=1))
        os.replace(built, target)  # the library first: a record names an intact file once it is in place
        os.replace(record, target.with_suffix(".json"))
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
    an unsupported platform or build target, a failed build or load, or ``self_check``'s complaint (a message; None:
    passed). ValueError where ``HF_TRIFORCE_CPU_MARCH`` names no build target."""
    why = switched_off(env) or unsupported_platform()
    if why is not None:
        return None, why
    target = unsupported_target()
    if target is not None:
        return None, f"unavailable ({target})"
    try:
        kernel = wrap(load(name, sources))
        error = self_check(kernel)
    except subprocess.TimeoutExpired as exc:
        return None, f"unavailable (the compiler ran past {exc.timeout:g} s)"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"unavailable ({type(exc).__name__}: {exc})"
    if error is not None:
        return None, f"unavailable (self-check against float64: {error})"
    return kernel, "on"


def bind(library: ctypes.CDLL, symbol: str, restype, *argtypes) -> Callable:
    """``library``'s C function ``symbol``, declared to take ``argtypes`` and return ``restype``."""
    function = getattr(library, symbol)
    function.argtypes, function.restype = list(argtypes), restype
    return function


def built(load_kernel: Callable[[], tuple[Kernel | None, str]], caller: str) -> Kernel:
    """The kernel ``load_kernel`` returns (a module's ``_load``); RuntimeError naming ``caller`` and why where it does
    not run."""
    kernel, why = load_kernel()
    if kernel is None:
        raise RuntimeError(f"{caller}: the kernel is {why}")
    return kernel
