"""moeplace: put experts and requests where the routing wants them.

Pipeline (one module per stage): trace -> analyse -> plan -> simulate -> run, plus models and the CLI.

Glossary (the full vocabulary is in docs/MODEL.md, shared with every stage):

- ``L`` MoE layers, ``E`` logical experts, ``K`` top-k experts per token per layer.
- ``T`` tokens of a trace; each token belongs to a request and has a phase (prefill or decode).
- Cluster ``N`` nodes x ``G`` GPUs per node = ``W`` expert-parallel ranks.
- ``P = E + R`` physical slots (``R`` redundant), ``S = P / W`` slots per GPU; slot ``p`` is on GPU ``p // S``.
- ``phy2log[l]`` int [P]: the logical expert each slot holds in layer ``l``.

Worked example (DeepSeek-V3): 256 logical + 32 redundant = 288 slots over 32 GPUs = 9 slots per GPU;
with 4 nodes of 8 GPUs, slot 100 lives on GPU 100 // 9 = 11, which is on node 11 // 8 = 1.
"""

__version__ = "0.1.0"
