"""Where models run: the forms ``--device`` takes and their resolution to a ``torch.device``.

Forms: ``auto`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``cpu``, ``cuda`` (the
current CUDA device) and ``cuda:N``. :func:`check_device_name` checks the form alone (argparse runs it
on the flag: no CUDA query); :func:`resolve_device` also checks that the machine has the device, so a
command fails with the flag and its fix before any model loads.
"""

from __future__ import annotations

import argparse
import re

import torch

DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
"""The accepted forms, as error and help texts name them."""
_FORM = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> str:
    """``name`` normalised (trimmed, lower case) when it is one of :data:`DEVICE_FORMS`; else a
    ``ValueError`` naming ``--device`` and the valid forms."""
    text = str(name).strip().lower()
    if not _FORM.fullmatch(text):
        raise ValueError(f"--device: expected {DEVICE_FORMS} (N = 0, 1, ...), got {str(name)[:40]!r}")
    return text


def device_arg(text: str) -> str:
    """An argparse type: :func:`check_device_name` (argparse then names the flag in its error)."""
    try:
        return check_device_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device: ")) from None


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The device ``name`` means on this machine.

    Args:
        name: one of :data:`DEVICE_FORMS`, or a ``torch.device`` of type cpu or cuda.

    Raises:
        ValueError: naming ``--device`` and the fix, for a malformed name, CUDA on a machine where
            torch sees none, or a CUDA index beyond the devices there are.
    """
    text = check_device_name(str(name))
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"--device {text}: torch sees no CUDA device on this machine (torch {torch.__version__}, "
                         f"{build}); use --device cpu or auto")
    device = torch.device(text)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        which = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
        raise ValueError(f"--device {text}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                         f"({which}); use one of them, or --device cuda or auto")
    return device
