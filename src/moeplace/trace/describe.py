"""Human-readable descriptions of traces (``moeplace trace info``, the demo)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB with one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_trace_info(info: dict) -> str:
    """The text of ``moeplace trace info`` from a :func:`moeplace.trace.reader.trace_info` answer."""
    tag = " [SYNTHETIC]" if info["synthetic"] else ""
    nt = info["num_tokens"]
    doms = ", ".join(f"{d}: {n}" for d, n in info["domains"].items()) or "-"
    lines = [
        f"trace      {info['path']}{tag}",
        f"model      {info['model']}  ({info['kind']}{'' if info['complete'] else ', INCOMPLETE'})",
        f"shape      L={info['num_layers']} MoE layers, E={info['num_experts']} experts, k={info['top_k']}, "
        f"shared={info['num_shared_experts']}, hidden={info['hidden_size']}",
        f"requests   {info['num_requests']}  (sampling rate {info['sampling_rate']:g})",
        f"tokens     prefill {nt['prefill']:,}  decode {nt['decode']:,}",
        f"domains    {doms}",
        f"on disk    {format_bytes(info['size_bytes'])} in {info['num_shards']} shard(s)",
    ]
    if info.get("foe_groups", 1) > 1:
        lines.append(f"FoE groups: {info['foe_groups']}  (K/H={info['top_k'] // info['foe_groups']} experts per "
                     f"group among E/H={info['num_experts'] // info['foe_groups']})")
    if info["source"]:
        lines.append(f"source     {info['source']}")
    return "\n".join(lines)
