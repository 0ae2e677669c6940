"""Stage 2, analyse: expert activation patterns of a trace, as numbers (JSON) and as a report (moeplace.analyse.report).

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, D = domains.

- :func:`analyse_trace` streams a trace and returns the stable JSON dict documented in docs/ANALYSIS.md.
- :mod:`moeplace.analyse.stats` holds the metrics as pure numpy functions over arrays
  (``load_stats(load_LE)``, ``pairwise_js(freq_DLE)``, ``coactivation_counts(ids_TLK, E)``, ...).
- :class:`TokenAccumulator` sums them over token chunks in bounded memory.
- :mod:`moeplace.analyse.reference` keeps plain for-loop versions to test the vectorised ones against.
"""

from moeplace.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "accumulate": ("TokenAccumulator",),
    "stats": ("coactivation_counts", "coactivation_lift", "follow_share", "gini", "interlayer_counts",
              "interlayer_lift", "js_divergence", "load_stats", "normalise", "pairwise_js",
              "prefill_decode_correlation", "row_pearson", "row_spearman", "shared_experts",
              "softmax_regression_accuracy", "stratified_split", "top_n_overlap", "top_pairs"),
    "summary": ("SCHEMA_VERSION", "analyse_trace", "to_json"),
})
