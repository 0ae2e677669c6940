"""What ``moeplace analyze`` is configured by, importable without numpy (the CLI reads these for its options)."""

DEFAULT_CHUNK_TOKENS = 65536  # tokens read and analysed per chunk; bounds memory
DEFAULT_WINDOW_TOKENS = 16384  # drift window in tokens, trace order
DEFAULT_MAX_REQUEST_BYTES = 1 << 30  # per-request count vectors: S x 2 x L x E float32 within this budget
