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
- Ownership: every file the atomic writers make is marked as moeplace's (an extended attribute holding its size
  and modification time, :func:`mark_written`); :func:`replace_problem` refuses an existing output moeplace did
  not write (or that was changed since), so the CLI never replaces a user's file. :func:`input_output_clash` refuses
  an output that is, lies inside or contains one of the command's inputs, or that two outputs share.
- JSON read anywhere in moeplace refuses duplicate object keys (``object_pairs_hook=``:func:`unique_keys`).
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
from collections.abc import Callable, Sequence
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


# ------------------------------------------------------------------------------------------ ownership of outputs

WRITTEN_XATTR = "user.moeplace.written"  # extended attribute marking a file or folder moeplace wrote


def _stamp(st: os.stat_result) -> bytes:
    """The mark's value: a folder's is ``dir``; a file's its size and modification time, so that a file edited
    in place (same inode, new contents) no longer counts as moeplace's."""
    return b"dir" if stat.S_ISDIR(st.st_mode) else f"{st.st_size}:{st.st_mtime_ns}".encode()


def mark_written(path: str | os.PathLike) -> bool:
    """Mark ``path`` (a file or folder, after its last write) as written by moeplace; False where the file system
    keeps no extended attributes (then :func:`replace_problem` treats it as not moeplace's)."""
    try:
        os.setxattr(path, WRITTEN_XATTR, _stamp(os.stat(path)), follow_symlinks=False)
    except (OSError, AttributeError):  # ENOTSUP (vfat, old tmpfs), or a platform without xattrs
        return False
    return True


def moeplace_wrote(path: str | os.PathLike) -> bool:
    """Whether ``path`` carries moeplace's mark and is unchanged since (a link is never moeplace's)."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return False
        return os.getxattr(path, WRITTEN_XATTR, follow_symlinks=False) == _stamp(st)
    except (OSError, AttributeError):
        return False


def replace_problem(dest: str | os.PathLike) -> str | None:
    """Why ``dest`` may not be replaced by a moeplace output, or None: it does not exist, or it is a file
    moeplace wrote, unchanged since, that the user may write. A file or link moeplace did not write, and a
    read-only file, are refused (so ``--json``, ``--out`` and every other output never destroy a user's file)."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # a parent that is a file, a name too long: output_path_problem names those
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link moeplace did not write; remove it or choose another output"
    if stat.S_ISDIR(st.st_mode):
        return None  # output_path_problem refuses a folder where a file belongs
    if not st.st_mode & 0o222 or not os.access(dest, os.W_OK):
        return "exists and is read-only; remove it or choose another output"
    if not moeplace_wrote(dest):
        return ("exists and moeplace did not write it (or it was changed since); remove it or choose another "
                "output")
    return None


def folder_replace_problem(folder: str | os.PathLike, names: Sequence[str]) -> str | None:
    """Why moeplace may not write the files ``names`` (relative; a name ending in ``/`` is a subfolder, all of
    whose files count) into ``folder``, or None: the folder must be creatable and writable, and every existing
    file it would replace one moeplace wrote (:func:`replace_problem`). Returns ``"PATH: problem"``."""
    root = Path(folder)
    if not os.fspath(folder):
        return "'': expected a folder name, got an empty string"
    for anc in [root, *root.parents]:
        if anc.exists() or anc.is_symlink():
            if not anc.is_dir():
                return f"{anc}: exists and is not a directory"
            if not os.access(anc, os.W_OK | os.X_OK):
                return f"{anc}: no permission to write in it"
            break
    for name in names:
        p = root / name.rstrip("/")
        files = [p]
        if name.endswith("/"):
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                return f"{p}: exists and is not a folder moeplace wrote; remove it or choose another output"
            files = sorted(x for x in p.rglob("*") if not x.is_dir() or x.is_symlink()) if p.is_dir() else []
        for f in files:
            problem = replace_problem(f)
            if problem:
                return f"{f}: {problem}"
    return None


def folder_output_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` may not be replaced by a folder moeplace builds whole (a model folder), or None: it must be
    creatable and writable, and, when it exists and is not empty, hold only files moeplace wrote, unchanged since
    (so nothing of the user's is lost when the new folder is swapped in). Returns ``"PATH: problem"``."""
    text = os.fspath(folder)
    if not text:
        return "'': expected a folder name, got an empty string"
    root = Path(text)
    if root.name in ("", ".", ".."):
        return f"{text}: expected a new folder's name, not the current or a parent folder"
    problem = folder_replace_problem(root, ())
    if problem or not root.is_dir() or root.is_symlink():
        return problem or (f"{root}: is a symbolic link; give the folder itself" if root.is_symlink() else None)
    for f in sorted(root.rglob("*")):
        if f.is_dir() and not f.is_symlink():
            continue
        if not moeplace_wrote(f):
            return (f"{root}: exists and holds {f.relative_to(root)}, which moeplace did not write (or which was "
                    "changed since); remove it or choose another output")
    return None


def mark_tree(folder: str | os.PathLike) -> None:
    """:func:`mark_written` on every file under ``folder`` (a folder moeplace just built, nothing else in it)."""
    for f in Path(folder).rglob("*"):
        if f.is_file() and not f.is_symlink():
            mark_written(f)


def move_folder_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished folder ``tmp`` to ``dest``; an existing ``dest`` is moved aside first (as
    ``.<name>.old-<pid>-*``, removed after the swap), so ``dest`` is the old folder or the whole new one."""
    if dest.exists() or dest.is_symlink():
        backup = temp_path(dest, "old")
        os.replace(dest, backup)
        os.replace(tmp, dest)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def input_output_clash(outputs: Sequence[tuple[str, str | os.PathLike]],
                       inputs: Sequence[tuple[str, str | os.PathLike]]) -> str | None:
    """Why these outputs may not be written, or None. ``outputs`` and ``inputs`` are (label, path) pairs, the
    label naming the option (``--json``) or argument (``TRACE``). Refused: an output that is an input (resolved
    paths, links and hard links included), lies inside an input folder (a trace) or contains an input, and two
    outputs that are the same path or one inside the other. Returns one line: ``"PATH (label): problem"``."""
    seen: list[tuple[str, Path, Path]] = []
    for label, out in outputs:
        o = Path(out)
        ro = o.resolve()
        for ilabel, inp in inputs:
            i = Path(inp)
            ri = i.resolve()
            if _same(o, i):
                return f"{out} ({label}): is the input {ilabel} {inp}; choose another output"
            if ri in ro.parents:
                return f"{out} ({label}): lies inside the input {ilabel} {inp}; choose another output"
            if ro in ri.parents:
                return f"{out} ({label}): contains the input {ilabel} {inp}; choose another output"
        for olabel, other, rother in seen:
            if _same(o, other) or ro in rother.parents or rother in ro.parents:
                return f"{out} ({label}): also given to {olabel}; give each output its own path"
        seen.append((label, o, ro))
    return None


class DuplicateKeyError(ValueError):
    """A JSON object with the same key twice (strict readers refuse it instead of keeping the last value)."""


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict; DuplicateKeyError on a repeated key."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"duplicate key {k[:80]!r} in a JSON object")
        out[k] = v
    return out


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
    try:
        os.mkdir(t, dir_mode())
    except PermissionError:  # name the destination, not the hidden temporary
        raise OutputError(f"{dest}: no permission to write in {dest.parent}") from None
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
        mark_written(tmp)  # after the last write: the mark holds the final size and mtime
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
