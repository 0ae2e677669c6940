"""Models the project ships or trains: the reference MoE (:mod:`moeplace.models.reference`), its corpus
(:mod:`moeplace.models.corpus`) and its training loop (:mod:`moeplace.models.train`).

Importing this package is cheap; torch and transformers load only when a model is built or loaded.
"""

from moeplace.models.reference import REFERENCE_DIR, ReferenceConfig, builtin_prompts, load_reference, preset

__all__ = ["REFERENCE_DIR", "ReferenceConfig", "builtin_prompts", "load_reference", "preset"]
