"""Models the project ships or trains: the reference MoE (:mod:`moeplace.models.reference`), its corpus
(:mod:`moeplace.models.corpus`), its training loop (:mod:`moeplace.models.train`) and the auxiliary-loss-free
balancing of the fine-grained (DeepSeek-V3-shaped) config (:mod:`moeplace.models.balancing`).

Importing this package is cheap; torch and transformers load only when a model is built or loaded.
"""

from moeplace.models.reference import REFERENCE_DIR, ReferenceConfig, builtin_prompts, load_reference, preset

__all__ = ["REFERENCE_DIR", "ReferenceConfig", "builtin_prompts", "load_reference", "preset"]
