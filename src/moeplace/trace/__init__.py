"""Stage 1, trace: the trace store (types, writer, reader, memory budget, on-disk format), capture from live
models and importers of engine dumps."""

from moeplace.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "types": ("DECODE", "FORMAT_VERSION", "PHASES", "PREFILL", "Counts", "Requests", "TokenChunk", "Trace",
              "TraceError", "TraceMeta"),
    "writer": ("TraceWriter", "write_trace"),
    "reader": ("iter_token_chunks", "read_counts", "read_meta", "read_requests", "read_trace", "read_trace_sample",
               "sample_request_ids", "trace_info"),
})
