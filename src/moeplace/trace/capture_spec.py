"""What ``moeplace trace record`` needs before torch is imported: the supported routers and the flush default.

Kept apart from :mod:`moeplace.trace.capture` (which imports torch) so that building the command line stays fast.
"""

ROUTER_CLASSES = (
    "MixtralTopKRouter",
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "OlmoeTopKRouter",
    "DeepseekV3TopkRouter",
    "GptOssTopKRouter",
)
DEFAULT_FLUSH_EVERY = 32  # requests between shard flushes in record_generate: what a kill -9 can lose
DEFAULT_PREFILL_BATCH_TOKENS = 1024  # padded tokens per forward of record_prefill (--max-new-tokens 0): the
# fastest of 256..4096 measured on the 2-core development machine (docs/CAPTURE.md); raise it on a GPU
DEFAULT_PREFILL_FLUSH_EVERY = 256  # requests between flushes of record_prefill: its sort window too; a prefill
# request costs a few milliseconds, so a kill loses seconds, and windows of 32 short prompts made forwards small

REFERENCE_NAME = "moeplace-reference"  # the model name a trace of ``--model reference`` records
