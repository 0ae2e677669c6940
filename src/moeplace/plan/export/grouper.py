"""The grouper a plan holds, exported for a request router (``moeplace export --format grouper``).

The JSON is self-contained (:meth:`moeplace.plan.route.Router.to_export`, schema
:class:`moeplace.schema.GrouperExportJSON`): format and version, the scorer rows (``weights`` [N][D]), the feature's
MoE layers and expert count, the deployment shape (nodes, GPUs per node, world size), the admission round size,
the model's layer layout when the plan records it, and text fields saying what a feature, the admission and the
rank / node / instance numbers mean. ``moeplace route serve --grouper FILE`` serves it (docs/ROUTE.md).
"""

from __future__ import annotations

import dataclasses

from moeplace.placement import Plan
from moeplace.plan.export.base import resolve_layers
from moeplace.plan.route import Router


def export_grouper(plan: Plan, moe_layer_map: list[int] | None = None, num_decoder_layers: int | None = None
                   ) -> dict:
    """The grouper export of ``plan``; ValueError when the plan has no grouper (it routes round-robin).

    The model's layer layout (which model layer each MoE layer is, what vLLM's ``routed_experts`` and SGLang's
    dumps are indexed by) is the plan's record, or ``moe_layer_map`` (e.g. from a trace) when given; unknown: null,
    and a router then takes routing over the plan's MoE layers only."""
    if moe_layer_map is not None or num_decoder_layers is not None:
        layers = resolve_layers(plan.placement.num_layers, moe_layer_map, num_decoder_layers, plan.model_layers)
        plan = dataclasses.replace(plan, model_layers=layers)
    return Router.from_plan(plan).to_export()


def from_grouper(d: object, where: str = "grouper file") -> Router:
    """A router from a grouper export, validated (SchemaError naming ``where``)."""
    return Router.from_export(d, where)
