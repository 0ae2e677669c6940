"""Data bundled with the package: the default trace the demo runs on, and its provenance (README.md here)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
REFERENCE_TRACE = DATA_DIR / "reference-default.trace"  # the project's own reference MoE, four domains
GPT_OSS_SAMPLE = DATA_DIR / "gpt-oss-20b-sample.trace"  # a small real sample of gpt-oss-20b decode routing
FOE_TRACE = DATA_DIR / "reference-foe.trace"  # a trained Federation-of-Experts model (H = 2), same prompts
FOE_H4_TRACE = DATA_DIR / "reference-foe-h4.trace"  # the same with H = 4 groups


def default_trace_path() -> Path:
    """The trace ``moeplace demo`` uses: routing of the project's reference MoE model on its held-out prompts of
    four domains (code, math, chat, general), prefill and decode (see reference/MODEL_CARD.md)."""
    if not REFERENCE_TRACE.exists():
        raise FileNotFoundError(f"bundled default trace missing: {REFERENCE_TRACE} (reinstall moeplace)")
    return REFERENCE_TRACE
