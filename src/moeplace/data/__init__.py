"""Data bundled with the package: the default trace the demo runs on, and its provenance."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
GPT_OSS_SAMPLE = DATA_DIR / "gpt-oss-20b-sample.trace"


def default_trace_path() -> Path:
    """The trace ``moeplace demo`` uses: a small real sample of gpt-oss-20b decode routing (see its README)."""
    if not GPT_OSS_SAMPLE.exists():
        raise FileNotFoundError(f"bundled default trace missing: {GPT_OSS_SAMPLE} (reinstall moeplace)")
    return GPT_OSS_SAMPLE
