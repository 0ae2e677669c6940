"""Typed schemas of the JSON files moeplace reads (plans, load matrices, engine mappings) and one strict reader.

Every JSON input goes through :func:`read_json_file` (a regular file under a size cap; strict JSON: no NaN or
Infinity, no number that overflows a double, nesting at most :data:`MAX_DEPTH` deep) and then through a pydantic
model via :func:`validate`, so that every error names the file, the field path and the problem, e.g.
``plan.json: cluster.gpus_per_node: field required``. Integers accept whole floats (``1.0``) but refuse ``1.5``,
booleans and strings; every number has a range that keeps the allocations made from it bounded.

pydantic is imported here only; the modules that need a schema import this one lazily, so commands that read no
JSON do not pay for it.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError

from moeplace.budget import over_budget
from moeplace.io import unique_keys

MAX_JSON_BYTES = 256 << 20  # largest JSON input read (a 94-layer x 2048-slot plan with 10^6 homes is ~30 MB)
MAX_DEPTH = 64  # deepest nesting of arrays and objects accepted in any JSON input
MAX_ID = (1 << 31) - 1  # expert, GPU, layer ids and counts fit in int32
MAX_REQUEST_ID = (1 << 63) - 1  # request ids are int64 in traces
# Peak bytes of memory per byte of JSON text while it is parsed, validated and turned into arrays: a list of small
# numbers ("1,") becomes 8-byte pointers (and 24-byte floats) in the parse, again in validation, then an array
JSON_PARSE_FACTOR = 24


class SchemaError(ValueError):
    """A JSON input that does not match its schema; the message names the file, the field path and the problem."""


# ------------------------------------------------------------------------------------------------- reading


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name} (numbers must be finite)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} overflows a double")
    return v


def json_depth(obj: object) -> int:
    """Deepest nesting of lists and dicts in ``obj`` (a scalar is 0), computed without recursion."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        elif not isinstance(o, list):
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in o if isinstance(x, (list, dict)))
    return deepest


def parse_json(text: str | bytes, where: str) -> object:
    """Strict JSON (no NaN/Infinity, finite numbers, depth <= MAX_DEPTH); SchemaError naming ``where``."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                         object_pairs_hook=unique_keys)
    except RecursionError:
        raise SchemaError(f"{where}: JSON nested too deeply (at most {MAX_DEPTH} levels)") from None
    except UnicodeDecodeError as e:
        raise SchemaError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise SchemaError(f"{where}: not valid JSON ({e})") from None
    except ValueError as e:  # parse hooks (a duplicate key included), and integers of more than 4300 digits
        raise SchemaError(f"{where}: not valid JSON ({e})") from None
    if json_depth(obj) > MAX_DEPTH:
        raise SchemaError(f"{where}: JSON nested too deeply (at most {MAX_DEPTH} levels)")
    return obj


def check_input_file(path: str | os.PathLike, what: str, max_bytes: int | None = MAX_JSON_BYTES,
                     parse_factor: float = JSON_PARSE_FACTOR) -> Path:
    """``path`` as a Path after checking it is a regular file of at most ``max_bytes`` whose reading, about
    ``parse_factor`` bytes of memory per byte of file, fits the memory budget (:mod:`moeplace.budget`).

    Raises FileNotFoundError when missing, SchemaError for a directory, FIFO, device or socket (a FIFO would
    block, /dev/zero would never end), for a file over the cap and for one whose reading would pass the budget.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no such {what}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SchemaError(f"{p}: is a directory, expected a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise SchemaError(f"{p}: not a regular file (a FIFO, device or socket), expected a {what}")
    if max_bytes is not None and st.st_size > max_bytes:
        raise SchemaError(f"{p}: {st.st_size} bytes is larger than the {max_bytes >> 20} MiB accepted for a {what}")
    problem = over_budget(st.st_size * parse_factor, f"reading this {what} ({st.st_size / 1e6:.1f} MB)", p)
    if problem:
        raise SchemaError(problem)
    return p


def read_json_file(path: str | os.PathLike, what: str = "JSON file") -> object:
    """Parse a JSON input file strictly (see :func:`check_input_file` and :func:`parse_json`)."""
    p = check_input_file(path, what)
    return parse_json(p.read_bytes(), str(p))


# ------------------------------------------------------------------------------------------------- types


def _whole_number(v: object) -> object:
    """1.0 -> 1 (JSON writers may print integers as floats); anything else is left to the strict int check."""
    if isinstance(v, float) and v.is_integer() and abs(v) <= MAX_REQUEST_ID:
        return int(v)
    return v


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, BeforeValidator(_whole_number), Strict(), Field(ge=lo, le=hi)]


Id = _int(0, MAX_ID)  # expert / GPU / layer id
Count = _int(0, MAX_ID)
PosCount = _int(1, MAX_ID)
Finite = Annotated[float, Strict(), Field(allow_inf_nan=False)]
NonNegFinite = Annotated[float, Strict(), Field(allow_inf_nan=False, ge=0)]
PosFinite = Annotated[float, Strict(), Field(allow_inf_nan=False, gt=0)]
Fraction = Annotated[float, Strict(), Field(allow_inf_nan=False, gt=0, le=1)]
Text = Annotated[str, Strict(), Field(max_length=1 << 16)]
RequestKey = Annotated[str, Strict(), Field(pattern=r"^-?[0-9]{1,18}$")]  # a request id as a JSON object key


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ClusterJSON(_Model):
    num_nodes: PosCount
    gpus_per_node: PosCount
    intra_bw: PosFinite | None = None
    inter_bw: PosFinite | None = None
    intra_latency: NonNegFinite | None = None
    inter_latency: NonNegFinite | None = None
    expert_flops: PosFinite | None = None
    hbm_bw: PosFinite | None = None
    compute_overhead: NonNegFinite | None = None


class GrouperJSON(_Model):
    kind: Text = "centroids"
    gpus_per_node: PosCount
    round_size: PosCount
    layers: list[Id] | None = None
    weights: list[list[Finite]]


class BalanceJSON(_Model):
    floor: Fraction
    achieved: NonNegFinite | None = None
    met: bool


class FallbackJSON(_Model):
    used: Text
    reason: Text


class CostModelJSON(_Model):
    objective: Text
    rule: Text | None = None
    dedup: Text | None = None
    hidden_size: PosCount | None = None
    dispatch_bytes: PosFinite | None = None
    combine_bytes: PosFinite | None = None
    intermediate_size: PosCount | None = None
    pair_flops: NonNegFinite | None = None
    overlap: bool = False
    decode_batch: PosCount = 256
    prefill_tokens: PosCount = 8192


class ModelLayersJSON(_Model):
    moe_layer_map: list[Id]
    num_decoder_layers: PosCount


class PlanJSONv2(_Model):
    format_version: Literal[2]
    strategy: Text
    cluster: ClusterJSON
    num_experts: PosCount
    num_layers: Count
    num_slots: PosCount
    allow_colocated_replicas: bool
    phy2log: list[list[Id]]
    homes: dict[RequestKey, Id]
    grouper: GrouperJSON | None
    balance: BalanceJSON | None
    fallback: FallbackJSON | None
    cost_model: CostModelJSON | None
    model_layers: ModelLayersJSON | None = None  # absent from plans written before it existed
    foe_groups: PosCount = 1  # Federation of Experts: H groups (written only when > 1)
    plan_seconds: NonNegFinite = 0.0  # not written any more (plans hold no timings); accepted from early v2 files
    planned_on: Text
    extra: dict[str, Any]


class PlanJSONv1(_Model):
    """Version 1 (moeplace <= 38bf2ff): grouper, fallback and floor lived in ``extra`` (see :class:`LegacyExtra`)."""

    format_version: Literal[1]
    strategy: Text = ""
    cluster: ClusterJSON
    num_experts: PosCount
    num_layers: Count | None = None
    num_slots: PosCount | None = None
    phy2log: list[list[Id]]
    homes: dict[RequestKey, Id] = {}
    plan_seconds: NonNegFinite = 0.0
    planned_on: Text = ""
    extra: dict[str, Any] = {}


class LegacyExtra(BaseModel):
    """Keys of a version-1 ``extra`` (and of a strategy's ``StrategyResult.extra``) that are typed fields now."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    grouper: GrouperJSON | None = None
    allow_colocated: bool = False
    fallback: Text | None = None
    balance_floor: Fraction | None = None
    planning_balancedness: list[NonNegFinite] | None = None
    num_redundant: Count | None = None
    cost_model: CostModelJSON | None = None


PLAN_MODELS: dict[int, type[_Model]] = {1: PlanJSONv1, 2: PlanJSONv2}

LoadRows = list[list[NonNegFinite]]
LOAD_ADAPTER = TypeAdapter(LoadRows | list[LoadRows])


class LoadObjectJSON(BaseModel):
    """SGLang's expert-distribution JSON: ``logical_count`` [L][E] or [B][L][E] (other keys are kept by SGLang)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    logical_count: LoadRows | list[LoadRows]


class SGLangMappingJSON(_Model):
    physical_to_logical_map: list[list[Id]]


class VLLMMappingJSON(_Model):
    format: Literal["vllm-eplb-state"] = "vllm-eplb-state"
    num_redundant_experts: Count
    ep_size: PosCount
    num_logical_experts: PosCount | None = None  # written since vLLM rebuilds the other maps from the physical one
    num_moe_layers: PosCount | None = None
    physical_to_logical_map: list[list[Id]]
    # derived by vLLM itself (compute_logical_maps); in older moeplace exports, checked when present
    logical_to_physical_map: list[list[list[Annotated[int, BeforeValidator(_whole_number), Strict(),
                                                      Field(ge=-1, le=MAX_ID)]]]] | None = None
    logical_replica_count: list[list[Count]] | None = None


class GrouperExportJSON(_Model):
    """``moeplace export --format grouper`` (:meth:`moeplace.plan.route.Router.to_export`): the grouper of a plan
    with what routing by it needs; the text fields say what the numbers mean and are not read back."""

    format: Literal["moeplace-grouper"]
    version: Literal[1]
    strategy: Text
    planned_on: Text
    kind: Text
    num_nodes: PosCount
    gpus_per_node: PosCount
    world_size: PosCount
    round_size: PosCount
    num_experts: PosCount
    num_moe_layers: PosCount
    layers: list[Id] | None  # MoE layers of the feature (None: all)
    moe_layer_map: list[Id] | None  # the model layer of each MoE layer (None: not known)
    num_decoder_layers: PosCount | None
    feature_size: PosCount
    feature: Text
    admission: Text
    numbering: dict[str, Text]
    weights: list[list[Finite]]


# ------------------------------------------------------------------------------------------------- validation


def field_path(loc: tuple) -> str:
    """('cluster', 'gpus_per_node') -> 'cluster.gpus_per_node'; ('phy2log', 3, 7) -> 'phy2log[3][7]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "list[", "union[", "nullable[", "constrained-str")):
            continue  # pydantic's internal steps (a union arm, a validator) are not fields
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def describe(err: ValidationError, where: str, prefix: str = "") -> str:
    """One line: the file, the field path and the problem of the first error (and how many more there are)."""
    errs = err.errors(include_url=False)
    e = errs[0]
    path = field_path(tuple(e["loc"]))
    path = f"{prefix}.{path}" if prefix and path != "(top level)" else (prefix or path)
    msg = e["msg"]
    if e["type"] == "missing":
        msg = "field required"
    elif e["type"] == "extra_forbidden":
        msg = "unknown field"
    else:
        got = repr(e.get("input"))
        msg += f", got {got[:60] + '...' if len(got) > 60 else got}"
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return f"{where}: {path}: {msg}{more}"


def validate(model: Any, data: object, where: str, prefix: str = "") -> Any:
    """``data`` validated against a pydantic model class or TypeAdapter; SchemaError naming ``where`` otherwise."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data)
        return model.model_validate(data)
    except ValidationError as e:
        raise SchemaError(describe(e, where, prefix)) from None
    except RecursionError:
        raise SchemaError(f"{where}: JSON nested too deeply (at most {MAX_DEPTH} levels)") from None


def plan_model(d: object, where: str) -> PlanJSONv1 | PlanJSONv2:
    """The plan JSON ``d`` validated against the model of its ``format_version``."""
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected a JSON object (a plan), got {type(d).__name__}")
    v = d.get("format_version")
    if "format_version" not in d:
        raise SchemaError(f"{where}: format_version: field required (this moeplace reads plan versions "
                          f"{sorted(PLAN_MODELS)})")
    if isinstance(v, bool) or not isinstance(v, int) or v not in PLAN_MODELS:
        raise SchemaError(f"{where}: format_version: unsupported plan version {v!r} (this moeplace reads "
                          f"{sorted(PLAN_MODELS)})")
    return validate(PLAN_MODELS[v], d, where)
