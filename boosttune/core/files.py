"""Files that readers may trust: atomic writes, the completion marker, content hashes.

A file is written under a temporary name and renamed into place, so a reader sees the old file or
the whole new one, never half of one. A directory is whole once its completion marker
(``complete.json``) exists, because the marker is the last file written into it. Run directories
(``rundir.py``), the model cache (``models.py``) and bundles (``serving/bundle.py``) all rely on
these few functions.

Files are created with the mode the user's umask gives (0644 under the usual 022), atomic ones too:
``tempfile.mkstemp`` alone makes them 0600. A write that fails (a full disk in safetensors, in
``torch.save`` or in Lightning's checkpointing) is reported as an ``OSError`` naming the file the run
means to have, not the temporary one beside it (:func:`writing`), so `boosttune train` prints one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MARKER = "complete.json"
"""The completion marker: the last file written into a directory that is then whole."""


def umask() -> int:
    """This process's umask, read without setting it where Linux shows it (``/proc/self/status``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: set and restore (another thread creating a file meanwhile gets 022)
    os.umask(mask)
    return mask


# safetensors reports I/O failures as SafetensorError with the OS error inside its text, in Rust's
# Debug form ("IoError(Os { code: 28, kind: StorageFull, ... })") or its Display form ("(os error 28)").
_RUST_ERRNO = re.compile(r"\bcode: (\d+)|\(os error (\d+)\)")


def os_error_of(e: BaseException) -> OSError | None:
    """The OS error that ``e`` is or carries (a SafetensorError's text names its errno); None if none."""
    if isinstance(e, OSError):
        return e
    m = _RUST_ERRNO.search(str(e)) if type(e).__name__ == "SafetensorError" else None
    if m is None:
        return None
    code = int(m.group(1) or m.group(2))
    return OSError(code, os.strerror(code))


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})
"""The errors that say a place cannot be written (others, e.g. a refused connection, pass unchanged)."""


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Inside: an OSError of :data:`WRITE_ERRNOS`, or a SafetensorError carrying one (a full disk), is
    raised again as an OSError with the same errno naming ``path``, the file or directory the run means
    to have (not the temporary name it was being written under)."""
    try:
        yield
    except Exception as e:
        err = os_error_of(e)
        if err is None or err.errno not in WRITE_ERRNOS:
            raise
        raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from e


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one; the file gets the
    mode the umask gives a new file, and a failure names ``path`` (:func:`writing`)."""
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o666 & ~umask())  # mkstemp's 0600 otherwise
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_json(path: Path, obj: Any, sort_keys: bool = False) -> None:
    """``obj`` as indented JSON, written atomically (:func:`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def mark_complete(directory: Path, info: dict | None = None, sort_keys: bool = False) -> None:
    """Declare ``directory`` whole: its marker (holding ``info``) is the last file written."""
    atomic_write_json(directory / MARKER, info or {}, sort_keys=sort_keys)


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds its completion marker."""
    return (directory / MARKER).is_file()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    # ~0.06 s for the 98 MB GGUF when it is in the page cache
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
