"""What moeplace must import from dumps of SGLang's expert-distribution recorder, derived from the router logits.

Shared by tests/test_importers.py (on the committed fixtures) and tests/test_interop_engines.py (on dumps SGLang
writes during the test). The engine side (tests/interop/sglang_engine.py ``record``) routes random logits
``[T, Lm, E]`` per forward pass through SGLang's ``select_experts`` and records them; here the expected logical
ids are the top-k of those logits (softmax is monotone, so top-k of softmax = top-k of logits, descending), and
everything else follows from the pass schedule. Nothing here reads the dump.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeplace.cli import main
from moeplace.trace import DECODE, PREFILL, read_counts, read_meta, read_trace

FIXTURES = Path(__file__).parent / "fixtures"
PER_TOKEN = FIXTURES / "sglang_per_token_0.5.23.pt"
STAT = FIXTURES / "sglang_stat_0.5.23.pt"
TRUTH = FIXTURES / "sglang_recorder_0.5.23.truth.json"  # the engine script's JSON answer (schedule, maps)
LOGITS = FIXTURES / "sglang_recorder_0.5.23.logits.npz"  # pass<i>: float [T, Lm, E]


def expected_ids(truth: dict, logits: dict) -> dict:
    """Per routed pass (not IDLE), in pass order: ``ids`` int [T, L, K] (L = MoE layers), ``phase`` [T],
    ``seq_lens`` (one request per extend sequence / decode token), ``positions`` [T]; ``counts`` int [passes, L, E]
    over all passes (IDLE included, all zero)."""
    first, k = truth["first_dense"], truth["top_k"]
    out = {"ids": [], "phase": [], "seq_lens": [], "positions": [], "counts": []}
    pos0 = 100  # the engine script numbers positions from 100 across passes
    for i, p in enumerate(truth["schedule"]):
        lg = np.asarray(logits[f"pass{i}"])[:, first:, :]  # [T, L, E]
        T, L, E = lg.shape
        ids = np.argsort(-lg, axis=2, kind="stable")[:, :, :k]  # descending, router order
        c = np.zeros((L, E), np.int64)
        for t in range(T):
            for layer in range(L):
                for e in ids[t, layer]:
                    c[layer, e] += 1
        out["counts"].append(c)
        if T == 0:
            continue
        mode, lens = p["forward_mode"], p["seq_lens"]
        phase = [PREFILL if mode == "EXTEND" or (mode == "MIXED" and n > 1) else DECODE for n in lens]
        out["ids"].append(ids)
        out["phase"].append(np.repeat(phase, lens))
        out["seq_lens"].extend(lens)
        out["positions"].append(np.arange(pos0, pos0 + T))
        pos0 += T
    return {k2: (np.concatenate(v) if k2 in ("ids", "phase", "positions") else np.asarray(v))
            for k2, v in out.items()}


def check_imports(per_token: Path, stat: Path, truth: dict, logits: dict, tmp: Path) -> dict:
    """Import both dumps with ``moeplace trace import`` and compare with :func:`expected_ids`; returns what was
    compared (for a report)."""
    want = expected_ids(truth, logits)
    assert main(["trace", "import", "--format", "sglang-per-token", str(per_token), str(tmp / "pt.trace"),
                 "--num-experts", str(truth["num_logical_experts"])]) == 0
    t = read_trace(tmp / "pt.trace")
    L = truth["num_layers"] - truth["first_dense"]
    moe_layers = list(range(truth["first_dense"], truth["num_layers"]))
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (L, truth["num_logical_experts"], truth["top_k"])
    assert t.meta.moe_layer_map == moe_layers
    np.testing.assert_array_equal(t.tokens.expert_ids, want["ids"])
    np.testing.assert_array_equal(t.tokens.phase, want["phase"])
    np.testing.assert_array_equal(t.tokens.position, want["positions"])
    lens = want["seq_lens"]
    np.testing.assert_array_equal(t.tokens.request_id, np.repeat(np.arange(len(lens)), lens))
    # a dump records physical slots: some tokens must have gone to a redundant replica, or the map went unused
    P2L = np.asarray(truth["physical_to_logical_map"])
    E = truth["num_logical_experts"]
    phys = [np.asarray(p["physical"]) for p in truth["schedule"] if p["seq_lens"]]
    assert any((ph[:, truth["first_dense"]:] >= E).any() for ph in phys)

    assert main(["trace", "import", "--format", "sglang-stat", str(stat), str(tmp / "st.trace"),
                 "--top-k", str(truth["top_k"])]) == 0
    meta, got = read_meta(tmp / "st.trace"), read_counts(tmp / "st.trace")
    routed = [i for i, p in enumerate(truth["schedule"]) if p["seq_lens"]]
    assert meta.kind == "counts" and meta.moe_layer_map == moe_layers
    assert got.group.tolist() == [f"pass{i}" for i in routed]
    np.testing.assert_array_equal(got.counts, want["counts"][routed])
    np.testing.assert_array_equal(got.num_tokens, [sum(truth["schedule"][i]["seq_lens"]) for i in routed])
    return {"per_token": {"tokens": int(len(t.tokens.phase)), "requests": int(len(lens)), "moe_layers": moe_layers,
                          "prefill_tokens": int((t.tokens.phase == PREFILL).sum()),
                          "decode_tokens": int((t.tokens.phase == DECODE).sum()),
                          "physical_slots": int(P2L.shape[1]), "logical_experts": E},
            "stat": {"passes": len(routed), "token_expert_pairs": int(got.counts.sum())}}


def load_truth(truth_path: Path, logits_path: Path) -> tuple[dict, dict]:
    with np.load(logits_path) as z:
        logits = {k: z[k] for k in z.files}
    return json.loads(truth_path.read_text()), logits
