"""Atomic file writes shared by every stage: a crash or Ctrl-C never leaves a half-written output behind.

Each write goes to a temporary file in the destination's folder, is flushed to disk, and is renamed over the
destination, so readers see either the old file or the whole new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(text: str, dest: str | os.PathLike) -> Path:
    """Write ``text`` (UTF-8) to ``dest`` atomically, creating its folder if needed; returns the path."""
    p = Path(dest)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def atomic_write_json(obj, dest: str | os.PathLike, indent: int | None = 1, allow_nan: bool = True) -> Path:
    """Write ``obj`` as JSON (one trailing newline) to ``dest`` atomically; returns the path."""
    return atomic_write_text(json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n", dest)


def atomic_write_bytes(data: bytes, dest: str | os.PathLike) -> Path:
    """Write ``data`` to ``dest`` atomically (an image, say); returns the path."""
    p = Path(dest)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p
