"""The deployable route (moeplace.plan.route): the function the evaluation gives held-out requests their homes with
is the one ``moeplace route serve`` answers, from the exported grouper file and from the engines' own routing
formats; online admission is deterministic and balanced; the HTTP service refuses bad input in one line.

Data: the bundled reference-default trace (real routing of the project's reference model) and the committed
SGLang / vLLM fixtures; the hand-made grouper scores in the admission tests are synthetic."""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.evaluate.windows import held_out_homes, split_windows
from moeplace.placement import Cluster, Grouper
from moeplace.placement.grouper import normalise_rows
from moeplace.plan import make_plan
from moeplace.plan.route import (
    MAX_BODY_BYTES,
    Router,
    counts_from_rows,
    counts_from_sglang,
    counts_from_topk,
    counts_from_vllm,
    signal_rows,
)
from moeplace.schema import SchemaError
from moeplace.trace import read_trace

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A grouped plan made on a planning window of the bundled trace, saved, and its grouper exported by the CLI;
    the windows (held-out requests in mixed arrival order)."""
    tmp = tmp_path_factory.mktemp("route")
    trace = read_trace(TRACE)
    win = split_windows(trace, 0.25, seed=0, arrival="mixed")
    plan = make_plan("activation-clusters", win.plan_work, Cluster.parse("2x2"), 8)
    assert plan.grouper is not None
    plan.save(tmp / "plan.json")  # as 'moeplace plan' on a window: no layer layout; the export takes the trace's
    assert main(["export", str(tmp / "plan.json"), "--format", "grouper", "--trace", str(TRACE),
                 "--out", str(tmp / "grouper.json")]) == 0
    return trace, win, plan, tmp


def reference_counts(held, prefix_tokens: int = 32) -> np.ndarray:
    """[Rq, L, E] prefill counts of each held-out request in table order, by a plain loop over its rows."""
    tk, meta = held.tokens, held.meta
    sig = signal_rows(tk.request_id, tk.phase, prefix_tokens)
    out = np.zeros((len(held.requests), meta.num_layers, meta.num_experts), np.float32)
    row_of = {int(r): i for i, r in enumerate(held.requests.request_id)}
    for t in np.flatnonzero(sig):
        i = row_of[int(tk.request_id[t])]
        for layer in range(meta.num_layers):
            for e in tk.expert_ids[t, layer]:
                out[i, layer, e] += 1
    return out


def reference_online(scores: np.ndarray, G: int, round_size: int) -> list[int]:
    """Online admission written out from docs/ROUTE.md: rounds of round_size rounded up to a multiple of W, a node
    takes at most its share of a round, best node with room, counters reset every round."""
    R, N = scores.shape
    round_size = -(-round_size // (N * G)) * (N * G)
    cap = round_size // N
    taken, nxt, out = [0] * N, [0] * N, []
    for i in range(R):
        best = sorted(range(N), key=lambda n: (-scores[i, n], n))
        n = next(x for x in best if taken[x] < cap)
        out.append(n * G + nxt[n] % G)
        taken[n] += 1
        nxt[n] += 1
        if (i + 1) % round_size == 0:
            taken = [0] * N
    return out


# ------------------------------------------------------------------------------------------ exactness


def test_exported_route_is_the_evaluations_homes(setup):
    """Route of the held-out requests through the exported file == the homes the evaluation scores with."""
    trace, win, plan, tmp = setup
    homes = held_out_homes(plan, win.held, win.held_signal)
    assert len(homes) == len(win.held.requests) > 100
    router = Router.load(tmp / "grouper.json")
    rid = win.held.requests.request_id
    ranks = router.route_batch(reference_counts(win.held))
    assert ranks.tolist() == [homes[int(r)] for r in rid]
    # the capture-hook adapter (token rows -> per-request counts) gives the same counts
    reqs, counts = counts_from_rows(win.held.tokens.request_id, win.held.tokens.phase, win.held.tokens.expert_ids,
                                    trace.meta.num_experts, 32)
    order = {int(r): i for i, r in enumerate(reqs)}
    np.testing.assert_array_equal(counts[[order[int(r)] for r in rid]], reference_counts(win.held))
    # and the homes spread over every GPU (a grouping that sends everything to one node would pass trivially)
    assert set(homes.values()) == set(range(4))


def test_online_admission_of_the_evaluation_is_the_services(setup):
    """held_out_homes(..., "online") == a fresh router's route() per request in arrival order, and leaves the
    caller's router state alone; an unknown admission is refused."""
    trace, win, plan, tmp = setup
    homes = held_out_homes(plan, win.held, win.held_signal, "online")
    r = Router.load(tmp / "grouper.json")
    counts = reference_counts(win.held)
    assert [homes[int(x)] for x in win.held.requests.request_id] == [r.route(c).rank for c in counts]
    assert homes != held_out_homes(plan, win.held, win.held_signal)  # the two forms differ here
    with pytest.raises(ValueError, match="admission must be one of"):
        held_out_homes(plan, win.held, win.held_signal, "later")


def test_route_on_a_layer_subset_is_the_evaluations_homes(setup):
    """A grouper over some MoE layers only (joint's for wide models): [L, E] and [L', E] inputs route alike."""
    trace, win, plan, tmp = setup
    rng = np.random.default_rng(3)
    E = trace.meta.num_experts
    g = Grouper(normalise_rows(rng.random((2, 3 * E))), 2, 16, "centroids", (1, 4, 6))
    p = dataclasses.replace(plan, grouper=g)
    homes = held_out_homes(p, win.held, win.held_signal)
    full = reference_counts(win.held)
    router = Router.from_export(json.loads(json.dumps(Router.from_plan(p).to_export())))
    rid = win.held.requests.request_id
    want = [homes[int(r)] for r in rid]
    assert router.route_batch(full).tolist() == want
    assert router.route_batch(full[:, [1, 4, 6], :]).tolist() == want
    feats = normalise_rows(full[:, [1, 4, 6], :])
    assert router.route_batch(full).tolist() == g.assign_features(feats).tolist()


def test_vllm_routed_experts_route_as_the_imported_trace(tmp_path):
    """vLLM 0.32's routed_experts (the committed fixture, base64 .npy as the server returns it): counts from the
    adapter equal the prefill counts of the trace the vLLM importer writes."""
    from moeplace.plan.route import npy_array
    from moeplace.trace.importers import import_trace

    out = import_trace("vllm-routed", FIXTURES / "vllm_routed_0.32.jsonl", tmp_path / "v.trace")
    tr = read_trace(out)
    E = tr.meta.num_experts
    lines = [json.loads(x) for x in (FIXTURES / "vllm_routed_0.32.jsonl").read_text().splitlines() if x.strip()]
    assert len(lines) == len(tr.requests)
    for i, d in enumerate(lines):
        rows = npy_array(d["routed_experts"], "fixture")
        got = counts_from_vllm(rows, len(d["prompt_token_ids"]), E, tr.meta.moe_layer_map,
                               d.get("routed_experts_prompt_start", 0))
        m = (tr.tokens.request_id == i) & (tr.tokens.phase == 0)
        np.testing.assert_array_equal(got, counts_from_topk(tr.tokens.expert_ids[m], E))
        assert got.sum() == m.sum() * tr.meta.num_layers * tr.meta.top_k > 0


def test_sglang_per_token_dump_routes_as_the_imported_trace(tmp_path):
    """SGLang 0.5.23's per_token dump (committed fixture): per extend sequence, counts from the adapter equal the
    imported trace's prefill counts of that request."""
    pytest.importorskip("torch")
    import torch

    from moeplace.trace.importers import import_trace

    src = FIXTURES / "sglang_per_token_0.5.23.pt"
    tr = read_trace(import_trace("sglang-per-token", src, tmp_path / "s.trace"))
    dump = torch.load(src, map_location="cpu", weights_only=True)
    p2l = np.asarray(dump["last_physical_to_logical_map"])
    E, K, lm = tr.meta.num_experts, tr.meta.top_k, tr.meta.moe_layer_map
    rid, checked = 0, 0
    for rec in dump["records"]:
        ids = np.asarray(rec["topk_ids_of_layer"])
        if ids.shape[1] == 0 or int(rec["forward_mode"]) not in (1, 2, 3):
            continue
        lens = [1] * ids.shape[1] if int(rec["forward_mode"]) == 2 else \
            [int(x) for x in np.asarray(rec.get("extend_seq_lens", [ids.shape[1]])) if int(x) > 0]
        start = 0
        for n in lens:
            m = tr.tokens.request_id == rid
            if int(rec["forward_mode"]) != 2 and n > 1 or int(rec["forward_mode"]) == 1:
                got = counts_from_sglang(ids[:, start:start + n], p2l, lm, K, E)
                np.testing.assert_array_equal(got, counts_from_topk(tr.tokens.expert_ids[m], E))
                checked += 1
            start += n
            rid += 1
    assert checked > 0


# ------------------------------------------------------------------------------------------ online admission


def synthetic_router(N: int = 3, G: int = 2, round_size: int = 12, E: int = 5, L: int = 2, seed: int = 0) -> Router:
    rng = np.random.default_rng(seed)
    return Router(Grouper(normalise_rows(rng.random((N, L * E))), G, round_size), E, L)


def test_online_route_is_the_documented_rule_and_balanced():
    """Synthetic requests that mostly prefer node 0: each round of round_size gives every node at most its cap,
    the ranks are those of the rule written out in reference_online, and a second router gives the same."""
    r = synthetic_router()
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 5, (100, 2, 5)).astype(np.float32)
    counts[:, :, 0] += 20 * (rng.random(100) < 0.7)[:, None]  # most requests look alike
    got = [r.route(c).rank for c in counts]
    assert got == reference_online(r.scores(counts), 2, 12)
    fresh = synthetic_router()
    assert [fresh.route(c).rank for c in counts] == got  # another router: the same answers
    nodes = np.asarray(got) // 2
    for s in range(0, 100, 12):
        assert np.bincount(nodes[s:s + 12], minlength=3).max() <= r.cap == 4
    assert r.admitted == 100 and r.round_position == 100 % 12
    r.reset()
    assert [r.route(c).rank for c in counts[:30]] == got[:30]
    d = r.decision(5)
    assert (d.rank, d.node, d.instance) == (5, 2, 2)


def test_online_route_equals_batch_when_no_node_fills():
    """With room on every node in each round, the online and batch forms agree request by request."""
    r = synthetic_router(N=2, G=1, round_size=8)
    w = r.grouper.weights
    counts = []
    for i in range(64):  # alternate the two nodes' favourites: 4 of 8 per node per round, the cap
        c = np.zeros((2, 5), np.float32)
        c.ravel()[np.argmax(w[i % 2] - w[1 - i % 2])] = 1
        counts.append(c)
    counts = np.stack(counts)
    online = [r.route(c).rank for c in counts]
    assert online == r.route_batch(counts).tolist()
    assert online == [i % 2 for i in range(64)]


def test_router_refuses_bad_counts():
    r = synthetic_router()
    for bad, match in ((np.ones((3, 5)), r"expected \[2, 5\]"), (np.ones((2, 4)), "expected"),
                       (-np.ones((2, 5)), ">= 0"), (np.full((2, 5), np.nan), "finite"),
                       ([[1, 2], [3]], "rectangular")):
        with pytest.raises(ValueError, match=match):
            r.route(bad)
    with pytest.raises(ValueError, match=r"expert id 5 is outside \[0, 5\)"):
        r.topk_counts([[[0, 5], [1, 2]]])


# ------------------------------------------------------------------------------------------ the export


def test_export_round_trips_and_is_self_describing(setup):
    trace, win, plan, tmp = setup
    d = json.loads((tmp / "grouper.json").read_text())
    assert (d["format"], d["version"], d["num_nodes"], d["gpus_per_node"], d["world_size"]) == \
        ("moeplace-grouper", 1, 2, 2, 4)
    assert (d["num_experts"], d["num_moe_layers"], d["feature_size"], d["round_size"]) == \
        (trace.meta.num_experts, trace.meta.num_layers, trace.meta.num_experts * trace.meta.num_layers,
         plan.grouper.round_size)
    assert set(d["numbering"]) == {"rank", "node", "instance"}
    r = Router.load(tmp / "grouper.json")
    np.testing.assert_array_equal(r.grouper.weights, plan.grouper.weights)  # bit for bit
    assert r.to_export() == d
    assert r.moe_layer_map == tuple(trace.meta.moe_layer_map)
    for bad, match in ((dict(d, version=2), "version"), (dict(d, format="x"), "format"),
                       (dict(d, num_nodes=3), "num_nodes=3"), (dict(d, feature_size=7), "feature_size=7"),
                       ({k: v for k, v in d.items() if k != "weights"}, "weights: field required"),
                       (dict(d, weights=[[1.0], [2.0, 3.0]]), "grouper file")):
        with pytest.raises(SchemaError, match=match):
            Router.from_export(bad)


def test_export_cli_refuses_a_plan_without_grouper(tmp_path, capsys):
    trace = read_trace(TRACE)
    win = split_windows(trace, 0.25, seed=0)
    make_plan("eplb", win.plan_work, Cluster.parse("2x2"), 8).save(tmp_path / "eplb.json")
    rc = main(["export", str(tmp_path / "eplb.json"), "--format", "grouper", "--out", str(tmp_path / "g.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "has no grouper" in err
    assert not (tmp_path / "g.json").exists()


def test_cli_defaults_are_the_librarys():
    from moeplace.cli import route_cmd
    from moeplace.plan import route

    assert (route_cmd.DEFAULT_HOST, route_cmd.DEFAULT_PORT, route_cmd.MAX_BODY_BYTES) == \
        (route.DEFAULT_HOST, route.DEFAULT_PORT, route.MAX_BODY_BYTES)


# ------------------------------------------------------------------------------------------ the HTTP service


@pytest.fixture(scope="module")
def service(setup):
    """``moeplace route serve`` started as the CLI starts it, on a free port; yields (base url, process)."""
    trace, win, plan, tmp = setup
    proc = subprocess.Popen([sys.executable, "-m", "moeplace", "route", "serve", "--grouper",
                             str(tmp / "grouper.json"), "--port", "0", "--max-body-bytes", str(1 << 20)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    m = re.search(r" on (http://127\.0\.0\.1:\d+): ", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    base = m.group(1)
    yield base, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def post(base: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
        return e.code, json.loads(text)


def test_service_answers_as_the_library(setup, service):
    """POST /route (online, a fresh process) == Router.route in the same order; POST /route_batch == the
    evaluation's homes; topk_ids and vLLM's base64 routed_experts are counted as the library counts them."""
    trace, win, plan, tmp = setup
    base, _ = service
    with urllib.request.urlopen(base + "/health", timeout=30) as resp:
        h = json.loads(resp.read())
    assert (h["status"], h["num_nodes"], h["gpus_per_node"], h["admitted"]) == ("ok", 2, 2, 0)
    counts = reference_counts(win.held)
    rid = win.held.requests.request_id
    homes = held_out_homes(plan, win.held, win.held_signal)
    code, got = post(base, "/route_batch", {"requests": [{"prefill_expert_counts": c.tolist()} for c in counts]})
    assert code == 200 and [d["rank"] for d in got["decisions"]] == [homes[int(r)] for r in rid]
    assert all(d["node"] == d["rank"] // 2 == d["instance"] for d in got["decisions"])
    local = Router.load(tmp / "grouper.json")
    want = [local.route(c).to_json() for c in counts[:70]]
    assert [post(base, "/route", {"prefill_expert_counts": c.tolist()})[1] for c in counts[:70]] == want
    # topk_ids of one held-out request's prompt rows
    tk = win.held.tokens
    m = (tk.request_id == rid[70]) & win.held_signal
    assert post(base, "/route", {"topk_ids": tk.expert_ids[m].tolist()})[1] == local.route(counts[70]).to_json()
    # vLLM's answer, as its OpenAI server returns it (the fixture is the same reference model)
    d = json.loads((FIXTURES / "vllm_routed_0.32.jsonl").read_text().splitlines()[0])
    body = {"routed_experts": d["routed_experts"], "prompt_len": len(d["prompt_token_ids"]),
            "routed_experts_prompt_start": d["routed_experts_prompt_start"]}
    from moeplace.plan.route import npy_array

    c = counts_from_vllm(npy_array(d["routed_experts"], "x"), body["prompt_len"], trace.meta.num_experts,
                         trace.meta.moe_layer_map, body["routed_experts_prompt_start"])
    assert post(base, "/route", body)[1] == local.route(c).to_json()
    with urllib.request.urlopen(base + "/health", timeout=30) as resp:
        assert json.loads(resp.read())["admitted"] == 72


def huge_npy_header() -> str:
    """A base64 .npy whose header claims 10^11 int64 values and holds none."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (10**11,)})
    return base64.b64encode(buf.getvalue()).decode()


def test_service_refuses_bad_input_in_one_line(setup, service):
    trace, win, plan, tmp = setup
    base, proc = service
    L, E = trace.meta.num_layers, trace.meta.num_experts
    cases = [
        (b"{not json", 400, "not valid JSON"),
        ({"prefill_expert_counts": [[1.0] * E] * (L - 1)}, 400, f"expected [{L}, {E}]"),
        ({"prefill_expert_counts": [[1.0] * E] * L, "topk_ids": [[[0]]]}, 400, "exactly one"),
        ({"topk_ids": [[[E] * 4] * L]}, 400, f"expert id {E} is outside"),
        ({"topk_ids": "abc"}, 400, "topk_ids"),
        ({"routed_experts": "!!notbase64", "prompt_len": 3}, 400, "base64"),
        ({"routed_experts": huge_npy_header(), "prompt_len": 3}, 400, "claims more data"),
        ({"routed_experts": [[[0] * 4] * L], "prompt_len": -1}, 400, "prompt_len"),
        ([1, 2], 400, "JSON object"),
        (b'{"prefill_expert_counts": [[1e400]]}', 400, "not valid JSON"),
        (b"[" * 100 + b"]" * 100, 400, "nested too deeply"),
        (b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
        (b'{"topk_ids": ' + b"[" * 60 + b"]" * 60 + b"}", 400, "topk_ids"),
        (b" " * ((1 << 20) + 1), 413, "over the"),
    ]
    for body, code, match in cases:
        got_code, got = post(base, "/route", body)
        assert got_code == code and match in got["error"], (str(body)[:80], got_code, got)
    for body in ({"requests": []}, {"requests": {}}, {"requests": [{"topk_ids": [[[0] * 4] * L]}, {}]}):
        code, got = post(base, "/route_batch", body)
        assert code == 400 and "requests" in got["error"], got
    code, got = post(base, "/nowhere", {})
    assert code == 404
    try:
        urllib.request.urlopen(base + "/route", timeout=30)
        raise AssertionError("GET /route answered")
    except urllib.error.HTTPError as e:
        assert e.code == 405
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/route")
    conn.endheaders()  # no Content-Length
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]
    conn.close()
    assert proc.poll() is None  # still serving
    with urllib.request.urlopen(base + "/health", timeout=30) as resp:
        assert json.loads(resp.read())["status"] == "ok"


def test_service_stops_cleanly_and_cli_errors_are_one_line(setup, tmp_path):
    trace, win, plan, tmp = setup
    run = [sys.executable, "-m", "moeplace", "route", "serve"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "moeplace-grouper", "version": 9}))
    for args, match in (([f"--grouper={bad}"], "version"), (["--grouper", str(tmp_path / "none.json")], "none.json"),
                        (["--grouper", str(tmp / "grouper.json"), "--host", "203.0.113.7", "--port", "0"],
                         "--host 203.0.113.7 --port 0: cannot listen there"),
                        (["--grouper", str(tmp / "grouper.json"), "--port", "70000"], "--port")):
        out = subprocess.run(run + args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and match in out.stderr, out.stderr
    proc = subprocess.Popen(run + ["--grouper", str(tmp / "grouper.json"), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert "POST /route" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped after 0 online routes" in out and err == ""


def test_body_cap_default_holds_a_long_prompt():
    """16 MiB holds an 8k-token prompt's topk_ids over 58 layers x 8 as JSON (~3.8 M ids, at most 4 bytes each)."""
    assert 8192 * 58 * 8 * 4 < MAX_BODY_BYTES


def test_npy_header_check_reads_a_real_array():
    from moeplace.plan.route import npy_array

    buf = io.BytesIO()
    np.save(buf, np.arange(24, dtype=np.uint8).reshape(2, 3, 4))
    np.testing.assert_array_equal(npy_array(base64.b64encode(buf.getvalue()).decode(), "x"),
                                  np.arange(24).reshape(2, 3, 4))
