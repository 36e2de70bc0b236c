"""The C++ ops of ``serving/native_ops.cpp``, built on first use with torch's extension builder.

``available()`` builds and loads them once per process (~20 s the first time on 2 cores, then cached by
torch under ``TORCH_EXTENSIONS_DIR``, ``~/.cache/torch_extensions`` by default) and says whether they
are there. Where the build fails (no C++ compiler or ninja) or ``BOOSTTUNE_NATIVE=0``, callers keep their
Python paths; the reason is in ``reason()``.
"""

from __future__ import annotations

import functools
import os
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
        from torch.utils import cpp_extension

        # torch looks for ninja on PATH; the virtual environment's own (pip's ninja) counts too
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        cpp_extension.load(name="boosttune_native", sources=[str(SOURCE)], extra_cflags=["-O2"],
                           is_python_module=False, verbose=False)
    except Exception as e:  # a missing compiler or ninja: the Python paths stay
        _why.append(f"{type(e).__name__}: {str(e)[:200]}")
        return False
    torch.library.register_fake("boosttune_native::linear")(_linear_shape)
    return True


def reason() -> str | None:
    """Why the native ops are not loaded (None: they are, or were not asked for yet)."""
    return _why[-1] if _why else None


def _linear_shape(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
