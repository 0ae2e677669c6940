"""Drops exist only where they exist: ``moeplace operate`` is dropless by default (as SGLang and vLLM serve), so
it reports no drop ratio and exports no drop metrics; with a capacity factor it counts the pairs above capacity
and exports them (the shipped MoePlaceDrops alert reads those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeplace.operate import OperateConfig, operate, trace_stream
from moeplace.operate.metrics import OperateMetrics
from moeplace.simulate import BatchConfig

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
GPT_OSS_SAMPLE = REPO / "src" / "moeplace" / "data" / "gpt-oss-20b-sample.trace"
DROP_METRICS = ("moeplace_drop_ratio", "moeplace_dropped_pairs")


def cluster():
    from moeplace.deploy import parse_cluster

    return parse_cluster("2", "h200-8")


def samples(m: OperateMetrics) -> dict[str, float]:
    fams = text_string_to_metric_families(m.exposition().decode())
    return {s.name: s.value for f in fams for s in f.samples if not s.labels}


def test_operate_config_default_is_dropless():
    assert OperateConfig(cluster()).capacity_factor is None


@pytest.mark.parametrize("cf", [None, 1.0])
def test_drop_metrics_only_with_a_capacity_factor(cf):
    cfg = OperateConfig(cluster(), num_redundant=16, window_requests=16, batching=BatchConfig(decode_batch=8),
                        capacity_factor=cf)
    m = OperateMetrics(drops=cf is not None)
    res = operate(trace_stream(GPT_OSS_SAMPLE, 16), cfg, "static", sink=m.update)
    val = samples(m)
    assert "moeplace_routed_pairs_total" in val
    if cf is None:
        assert not any(k.startswith(DROP_METRICS) for k in val)
        assert all(w.drop_ratio is None and "drop_ratio" not in w.to_json() for w in res.windows)
    else:
        dropped = sum(w.dropped_pairs for w in res.windows)
        assert dropped > 0 and val["moeplace_dropped_pairs_total"] == dropped
        assert val["moeplace_drop_ratio"] == pytest.approx(res.windows[-1].drop_ratio)
        assert res.windows[-1].to_json()["drop_ratio"] == res.windows[-1].drop_ratio


def test_documented_operate_command_reports_no_drops(tmp_path):
    """docs/OPERATE.md's command: it printed drop ratio 0.394 before drops became opt-in."""
    out = subprocess.run([sys.executable, "-m", "moeplace", "operate", str(REFERENCE), "--order", "drift",
                          "--drift-requests", "128", "--cluster", "4", "--cluster-preset", "h200-8", "--redundant",
                          "32", "--model-preset", "gpt-oss-20b", "--policy", "static", "--json",
                          str(tmp_path / "o.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    j = json.loads((tmp_path / "o.json").read_text())
    assert j["params"]["capacity_factor"] is None
    assert not any("drop" in k for w in j["windows"] for k in w)
    assert "drop" not in out.stdout
