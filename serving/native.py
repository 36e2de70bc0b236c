"""The C++ ops of ``serving/native_ops.cpp``, built on first use with torch's extension builder.

``available()`` builds and loads them once per process (~20 s the first time on 2 cores, then cached by
torch under ``TORCH_EXTENSIONS_DIR``, ``~/.cache/torch_extensions`` by default) and says whether they
are there. They are built for the CPU at hand (``-march=native``: the int8 product's loops vectorise to
its widest registers; OpenMP for its threads), so the build's name carries a digest of the CPU's model and
flags: a cache shared by machines with other CPUs builds once per CPU instead of loading code that one of
them cannot run. Where the build fails (no C++ compiler, ninja or OpenMP) or ``BOOSTTUNE_NATIVE=0``,
callers keep their Python paths; the reason is in ``reason()``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_ops.cpp")
_why: list[str] = []


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.boosttune_native`` is loaded (building it on the first call)."""
    if os.environ.get("BOOSTTUNE_NATIVE", "1") == "0":
        _why.append("BOOSTTUNE_NATIVE=0")
        return False
    try:
        build(f"boosttune_native_{cpu_digest()}", SOURCE)
    except Exception as e:  # a missing compiler or ninja: the Python paths stay
        _why.append(f"{type(e).__name__}: {str(e)[:200]}")
        return False
    torch.library.register_fake("boosttune_native::linear")(_linear_shape)
    torch.library.register_fake("boosttune_native::int8_mm")(_int8_mm_shape)
    torch.library.register_fake("boosttune_native::w8a8_mm")(_w8a8_mm_shape)
    torch.library.register_fake("boosttune_native::attend_rows")(_sdpa_shape)
    torch.library.register_fake("boosttune_native::attend")(_sdpa_shape)
    torch.library.register_fake("boosttune_native::attend_prompts")(_prompts_shape)
    return True


def build(name: str, source: Path, directory: str | None = None) -> None:
    """Build and load ``source`` (a copy of native_ops.cpp, its ops under some namespace) as ``name``, for the
    CPU at hand; ``directory``: where to build (default: torch's extension cache)."""
    from torch.utils import cpp_extension

    # torch looks for ninja on PATH; the virtual environment's own (pip's ninja) counts too
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(name=name, sources=[str(source)], build_directory=directory,
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)


def reason() -> str | None:
    """Why the native ops are not loaded (None: they are, or were not asked for yet)."""
    return _why[-1] if _why else None


def cpu_digest() -> str:
    """8 hex digits naming this CPU: its model and flags (Linux), else what ``platform`` knows."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _int8_mm_shape(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _w8a8_mm_shape(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _sdpa_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _prompts_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def _linear_shape(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
