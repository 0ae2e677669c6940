"""Safe outputs shared by every stage: atomic writes that respect the umask, and the temporary names they use.

Each write goes to a temporary file in the destination's folder, is flushed to disk, and is renamed over the
destination, so readers see either the old file or the whole new one (docs/RELIABILITY.md).

- Modes: a new file gets ``0o666 & ~umask`` and a new folder ``0o777 & ~umask``, as ``open()`` and ``mkdir``
  would give; the temporary file's private 0600 never reaches the destination.
- Temporary names are ``.<name>.<tag>-<pid>-<random>``; a name too long for the file system (255 bytes) is
  shortened and given a hash, so any legal destination name works.
- A destination that is an existing folder, or whose parent is not a folder, raises :class:`OutputError`
  naming the path.
- Leftovers of a killed run (temporaries whose process is gone) are removed by :func:`remove_stale`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

NAME_MAX = 255  # bytes in one path component on Linux and macOS file systems
_SHORT_STEM = 96  # bytes of the original name kept in a shortened temporary name


class OutputError(ValueError):
    """An output path that cannot be written as asked; the message names the path and the problem."""


def current_umask() -> int:
    """The process umask (read from /proc when possible, so no other thread sees a changed umask)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """Mode of a new file: 0o666 & ~umask."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """Mode of a new folder: 0o777 & ~umask."""
    return 0o777 & ~current_umask()


def temp_prefix(name: str, tag: str) -> str:
    """Prefix of the temporary names made for ``name``: ``.<name>.<tag>-`` (shortened with a hash if too long).

    The prefix plus a pid and a random suffix (about 40 bytes) always fits in :data:`NAME_MAX` bytes.
    """
    prefix = f".{name}.{tag}-"
    if len(prefix.encode()) + 40 <= NAME_MAX:
        return prefix
    digest = hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    stem = name.encode("utf-8", "surrogateescape")[:_SHORT_STEM].decode("utf-8", "ignore")
    return f".{stem}~{digest}.{tag}-"


def temp_path(dest: Path, tag: str) -> Path:
    """A fresh temporary path beside ``dest``: ``.<name>.<tag>-<pid>-<random>`` (not created)."""
    return dest.parent / f"{temp_prefix(dest.name, tag)}{os.getpid()}-{secrets.token_hex(6)}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_paths(dest: Path, tag: str) -> list[Path]:
    """``dest``'s temporaries of ``tag`` whose process no longer runs (left by a killed run)."""
    parent = dest.parent
    prefix = temp_prefix(dest.name, tag)
    pat = re.compile(re.escape(prefix) + r"(\d+)-")
    try:
        entries = list(parent.iterdir()) if parent.is_dir() else []
    except OSError:
        return []
    out = []
    for p in entries:
        m = pat.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            out.append(p)
    return sorted(out)


def remove_stale(dest: Path, tag: str) -> list[Path]:
    """Remove ``dest``'s temporaries of ``tag`` left by processes that no longer run; returns what was removed."""
    removed = []
    for p in stale_paths(dest, tag):
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


TEMP_SUFFIX_BYTES = 24  # the atomic writer's ".NAME.XXXXXXXX.tmp" adds this much to a file name


def output_path_problem(dest: str | os.PathLike) -> str | None:
    """What stops ``dest`` from being written as a file, or None: a directory (or a name ending in a separator),
    a FIFO, device or socket, a name longer than the file system allows, a path the OS refuses (too long,
    a parent that is a file, a loop, no access), or a nearest existing folder this process may not write in."""
    text = os.fspath(dest)
    p = Path(text)
    if not text or text.endswith(os.sep) or p.name in ("", ".", ".."):
        return "expected a file name, got a directory"
    n = len(os.fsencode(p.name))
    if n > NAME_MAX:  # the writer's temporary names are shortened, so any legal name can be written
        return f"file name too long ({n} bytes; at most {NAME_MAX})"
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:  # a parent is a file: name it
        anc = next((a for a in p.parents if a.exists() and not a.is_dir()), p.parent)
        return f"{anc} is not a directory"
    except OSError as e:  # ENAMETOOLONG of the whole path, ELOOP, EACCES
        return e.strerror or str(e)
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if st is not None and not stat.S_ISREG(st.st_mode):
        return "exists and is not a regular file (a FIFO, device or socket)"
    for anc in [p.parent, *p.parent.parents]:
        if anc.exists() or anc.is_symlink():
            if not anc.is_dir():
                return f"{anc} is not a directory"
            if not os.access(anc, os.W_OK | os.X_OK):
                return f"no permission to write in {anc}"
            break
    return None


def check_output_path(dest: str | os.PathLike, what: str = "output") -> Path:
    """Check that ``dest`` can be written as a file (:func:`output_path_problem`); OutputError ``"DEST: problem"``
    otherwise. Missing folders are created at write time. The one output-path check: the CLI's ``output_file``
    type and every writer call it before any work."""
    problem = output_path_problem(dest)
    if problem:
        text = os.fspath(dest)
        shown = text if len(text) <= 80 else f"{text[:40]}...{text[-40:]}"
        raise OutputError(f"{shown}: {problem} ({what})")
    return Path(dest)


def make_dirs(path: str | os.PathLike) -> Path:
    """``mkdir -p`` with a clear error when a component is a file; new folders get 0o777 & ~umask."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{p}: exists and is not a directory") from None
    except NotADirectoryError:
        raise OutputError(f"{p}: a parent of it is not a directory") from None
    return p


def make_temp_dir(dest: Path, tag: str = "new") -> Path:
    """Create an empty folder beside ``dest`` under a temporary name, with mode 0o777 & ~umask."""
    make_dirs(dest.parent)
    t = temp_path(dest, tag)
    os.mkdir(t, dir_mode())
    os.chmod(t, dir_mode())
    return t


def atomic_write_with(dest: str | os.PathLike, write: Callable[[Path], None], what: str = "output") -> Path:
    """Write ``dest`` atomically: ``write(tmp)`` fills a temporary file beside it, then fsync and rename.

    The file gets mode 0o666 & ~umask. On any failure (Ctrl-C included) the temporary is removed and ``dest``
    is untouched.
    """
    p = check_output_path(dest, what)
    make_dirs(p.parent)
    remove_stale(p, "tmp")
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(p.name, "tmp") + f"{os.getpid()}-", dir=p.parent)
    try:
        os.fchmod(fd, file_mode())
        os.close(fd)
        fd = -1
        write(Path(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return p


def atomic_write_bytes(data: bytes, dest: str | os.PathLike, what: str = "output") -> Path:
    """Write ``data`` to ``dest`` atomically (see :func:`atomic_write_with`); returns the path."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    return atomic_write_with(dest, write, what)


def atomic_write_text(text: str, dest: str | os.PathLike, what: str = "output") -> Path:
    """Write ``text`` (UTF-8) to ``dest`` atomically, creating its folder if needed; returns the path."""
    return atomic_write_bytes(text.encode("utf-8"), dest, what)


def atomic_write_json(obj, dest: str | os.PathLike, indent: int | None = 1, allow_nan: bool = True) -> Path:
    """Write ``obj`` as JSON (one trailing newline) to ``dest`` atomically; returns the path."""
    return atomic_write_text(json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n", dest)
