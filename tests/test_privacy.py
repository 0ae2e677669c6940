"""What a trace keeps and what it never keeps (docs/PRIVACY.md): importers drop token ids and text and say so; the
counts-only capture keeps per-window counts only, enough for eplb; operate's HTTP server listens on loopback
unless told otherwise and serves nothing that identifies a request.

Every check reads the written files back independently (pyarrow, raw bytes, /proc/net/tcp, the served bodies),
not through moeplace's reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import shared_data

from moeplace.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
VLLM_032 = FIXTURES / "vllm_routed_0.32.jsonl"
SGL_PER_TOKEN = FIXTURES / "sglang_per_token_0.5.23.pt"

# Every column a trace file may hold (docs/TRACE_FORMAT.md): none of them is a token id or text.
TOKEN_COLUMNS = {"request_id", "position", "phase", "expert_ids", "expert_weights"}
REQUEST_COLUMNS = {"request_id", "domain", "source", "prompt_len", "gen_len"}
COUNT_COLUMNS = {"group", "domain", "phase", "num_tokens", "counts"}
# Planted token ids: no expert id (< 32), position, length or request number of these small traces comes near them.
PLANTED = [48611, 27183, 31415, 9265, 35897, 32384, 62643, 38327, 9502, 28841, 19716, 39937]


def _columns(trace: Path) -> dict[str, set[str]]:
    """Column names of every Parquet file of ``trace``, read with pyarrow."""
    return {f.name: set(pq.read_schema(f).names) for f in sorted(trace.glob("*.parquet"))}


def _values(trace: Path) -> tuple[list[np.ndarray], list[str]]:
    """Every numeric column of every Parquet file of ``trace``, flattened (lists too), and every string value."""
    nums, strs = [], []
    for f in sorted(trace.glob("*.parquet")):
        t = pq.read_table(f)
        for name in t.column_names:
            col = t.column(name).combine_chunks()
            while pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
                col = col.flatten()
            vals = col.to_pylist()
            if vals and isinstance(vals[0], str):
                strs += vals
            else:
                nums.append(np.asarray(vals, dtype=np.float64))
    return nums, strs


def _has_run(a: np.ndarray, seq: list[int]) -> bool:
    """Whether ``seq`` occurs as consecutive entries of ``a``."""
    n = len(seq)
    if len(a) < n:
        return False
    win = np.lib.stride_tricks.sliding_window_view(a, n)
    return bool((win == np.asarray(seq, np.float64)).all(axis=1).any())


def _byte_forms(seq: list[int]) -> list[bytes]:
    """``seq`` as the bytes a file could hold it in: little-endian integers of every width, and decimal text."""
    forms = [np.asarray(seq, dt).tobytes() for dt in ("<u2", "<i4", "<i8")]
    forms += [", ".join(map(str, seq)).encode(), ",".join(map(str, seq)).encode()]
    return forms


def assert_no_token_ids(trace: Path, seqs: list[list[int]]) -> None:
    """No column beyond the documented ones, and none of ``seqs`` (token id sequences of the source) in any
    decoded column, in meta.json or in the raw bytes of any file of the trace."""
    cols = _columns(trace)
    assert cols, f"{trace}: no Parquet files"
    for name, c in cols.items():
        allowed = (REQUEST_COLUMNS if name.endswith(".requests.parquet") else
                   TOKEN_COLUMNS if name.endswith(".tokens.parquet") else COUNT_COLUMNS)
        assert c <= allowed, f"{name}: unexpected columns {sorted(c - allowed)}"
    nums, strs = _values(trace)
    blobs = [p.read_bytes() for p in trace.iterdir() if p.is_file()]
    for seq in seqs:
        probe = seq[:4]  # four consecutive ids already identify the run
        assert not any(_has_run(a, probe) for a in nums), f"token ids {probe} found in a column of {trace}"
        text = ", ".join(map(str, probe))
        assert not any(text in s or ",".join(map(str, probe)) in s for s in strs)
        for form in _byte_forms(probe):
            assert not any(form in b for b in blobs), f"token ids {probe} found in the bytes of {trace}"


# --------------------------------------------------------------------------------------------------- importers


def test_vllm_import_keeps_no_token_ids(tmp_path, capsys):
    """The real vLLM 0.32 fixture with its prompt_token_ids / output_token_ids replaced by planted ids: the trace
    holds their lengths only, and the command says what it left out."""
    rows = [json.loads(x) for x in VLLM_032.read_text().splitlines() if x.strip()]
    seqs, k = [], 0
    for r in rows:
        for key in ("prompt_token_ids", "output_token_ids"):
            n = len(r[key])
            r[key] = [PLANTED[(k + i) % len(PLANTED)] for i in range(n)]
            seqs.append(r[key])
            k += 1
        r["prompt"] = "PLANTED-PROMPT-TEXT the password is hunter2"
    src = tmp_path / "routed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "v.trace"
    assert main(["trace", "import", "--format", "vllm-routed", str(src), str(out)]) == 0
    err = capsys.readouterr().err
    assert "not imported" in err and "prompt_token_ids" in err and "output_token_ids" in err
    meta = json.loads((out / "meta.json").read_text())
    assert "prompt_token_ids" in meta["extra"]["not_imported"]
    assert_no_token_ids(out, seqs)
    assert not any(b"hunter2" in p.read_bytes() for p in out.iterdir())
    # the lengths are what is kept
    req = pq.read_table(out / "part-00000.requests.parquet").to_pydict()
    assert req["prompt_len"] == [len(r["prompt_token_ids"]) for r in rows]
    assert req["gen_len"] == [len(r["output_token_ids"]) for r in rows]


def test_sglang_per_token_import_keeps_no_input_ids(tmp_path, capsys):
    """SGLang 0.5.23's own per_token dump (input_ids next to topk_ids in every record), once as committed and once
    with planted input_ids: no column and no byte of the trace holds them."""
    import torch

    d = torch.load(SGL_PER_TOKEN, weights_only=True)
    assert all("input_ids" in r for r in d["records"])
    seqs = []
    for j, r in enumerate(d["records"]):
        r["input_ids"] = [PLANTED[(j + i) % len(PLANTED)] for i in range(len(r["input_ids"]))]
        if len(r["input_ids"]) >= 4:
            seqs.append(r["input_ids"])
    assert seqs
    planted = tmp_path / "expert_distribution_recorder_0.pt"
    torch.save(d, planted)
    for src in (SGL_PER_TOKEN, planted):
        out = tmp_path / f"{src.stem}.trace"
        assert main(["trace", "import", "--format", "sglang-per-token", str(src), str(out)]) == 0
        err = capsys.readouterr().err
        assert "not imported" in err and "input_ids" in err
        assert "input_ids" in json.loads((out / "meta.json").read_text())["extra"]["not_imported"]
        assert_no_token_ids(out, seqs)


@pytest.mark.shared_data
def test_gpt_oss_import_keeps_no_prompt_text(tmp_path, capsys):
    """The published gpt-oss-20b data carries each prompt's text and the generated tokens; the trace keeps neither."""
    src = shared_data("gpt-oss-20b")
    with open(src / "decode_routing_meta.jsonl") as fh:
        first = [json.loads(next(fh)) for _ in range(2)]
    out = tmp_path / "g.trace"
    assert main(["trace", "import", "--format", "gpt-oss-npz", str(src), str(out), "--limit", "2"]) == 0
    assert "original_prompt" in capsys.readouterr().err
    _, strs = _values(out)
    blobs = [p.read_bytes() for p in out.iterdir() if p.is_file()]
    for r in first:
        prompt = r["original_prompt"].strip()[:40]
        generated = "".join(r["generated_tokens"][4:14])
        for snippet in (prompt, generated):
            assert len(snippet) >= 10
            assert not any(snippet in s for s in strs)
            assert not any(snippet.encode() in b for b in blobs)


def test_every_importer_says_what_it_leaves_out():
    from moeplace.trace.importers import IMPORTERS, NOTHING_NOT_IMPORTED, not_imported

    for name, f in IMPORTERS.items():
        assert not_imported(name)
        if not f.counts_only:  # every per-token format carries token content next to the routing
            assert f.not_imported and not_imported(name) != NOTHING_NOT_IMPORTED, name
    assert "input_ids" in not_imported("sglang-per-token")
    assert "prompt_token_ids" in not_imported("vllm-routed")
