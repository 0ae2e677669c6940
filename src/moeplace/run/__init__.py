"""Stage 5, execute: the expert-parallel MoE layer run for real across processes, on emulated nodes.

Modules, in pipeline order: :mod:`~moeplace.run.layer` (experts and combine math),
:mod:`~moeplace.run.dispatch` (counts then rows with ``all_to_all_single``; one-hop and two-hop),
:mod:`~moeplace.run.launch` (W rank processes, gloo on CPU / NCCL on GPUs), :mod:`~moeplace.run.netns`
(emulated nodes: Linux network namespaces with shaped links) and :mod:`~moeplace.run.replay` (a trace through
the layer, bytes and time measured). See docs/RUNTIME.md.
"""
