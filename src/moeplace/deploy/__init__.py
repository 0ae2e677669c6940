"""What describes a deployment: the cluster (topology + hardware), model sizes, kernels, replica rule, batch sizes.

- :mod:`~moeplace.deploy.hardware`: GPU systems (:class:`Hardware`, :data:`CLUSTER_PRESETS`) and
  :func:`parse_cluster`, the one parser of ``--cluster`` / ``--cluster-preset``.
- :mod:`~moeplace.deploy.models`: model presets (:data:`MODEL_PRESETS`), sizes from published configs.
- :class:`Deployment`: every option of the deployment group (``moeplace.cli.options``) in one record; the
  commands that price time (plan, compare, simulate, operate, run-ep, demo) take it, and a plan records what it
  was optimised for in its ``cost_model``.

Its defaults are the library's (``simulate.CostConfig`` and ``simulate.BatchConfig``; a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeplace.deploy.hardware import (
    CLUSTER_PRESETS,
    HARDWARE_FIELDS,
    ClusterPreset,
    Hardware,
    cluster_note,
    get_cluster_preset,
    parse_cluster,
)
from moeplace.deploy.models import MODEL_PRESETS, ModelPreset, expert_groups, find_model, get_model

if TYPE_CHECKING:  # the CLI imports this package to build its options, without numpy
    from moeplace.placement import Cluster

DEFAULT_MODE = "auto"  # kernel mode: deepep-normal for prefill, deepep-ll for decode
DEFAULT_RULE = "nearest-least-loaded"  # replica rule (moeplace.simulate.routing.RULES)


@dataclass(frozen=True)
class Deployment:
    """One deployment as the options group gives it: where the plan runs and what a layer costs there."""

    cluster: Cluster  # topology (N x G) and hardware (links, latencies, GPU speed, HBM)
    cluster_preset: str | None = None  # the preset the hardware came from (None: the Cluster defaults)
    hidden_size: int | None = None  # elements per token vector; None: the trace's
    dispatch_bytes: float = 1.0  # bytes per element sent by dispatch (1 = fp8)
    combine_bytes: float = 2.0  # bytes per element returned by combine (2 = bf16)
    mode: str = DEFAULT_MODE  # dispatch/combine kernel (moeplace.simulate.kernels.MODES)
    rule: str = DEFAULT_RULE  # replica choice rule
    overlap: bool = False  # two-batch overlap of dispatch, expert compute and combine
    decode_batch: int = 256  # requests per decode window
    prefill_tokens: int = 8192  # prefill micro-batch token budget
    decode_running: int | None = None  # continuous batching: running requests over all GPUs (None: windows)
    intermediate_size: int | None = None  # routed expert FFN width (None: the model preset's, else hidden)
    profile: str | None = None  # the deployment profile this came from (moeplace.deploy.profiles), if any

    def time_params(self) -> dict[str, object]:
        """The time-model keywords a strategy that prices time declares (hidden_size .. prefill_tokens)."""
        return {k: getattr(self, k) for k in TIME_PARAMS}


TIME_PARAMS = ("hidden_size", "dispatch_bytes", "combine_bytes", "mode", "rule", "overlap", "decode_batch",
               "prefill_tokens", "decode_running", "intermediate_size")

__all__ = ["CLUSTER_PRESETS", "HARDWARE_FIELDS", "MODEL_PRESETS", "TIME_PARAMS", "ClusterPreset", "Deployment",
           "Hardware", "ModelPreset", "cluster_note",
           "expert_groups", "find_model", "get_cluster_preset", "get_model", "parse_cluster"]
