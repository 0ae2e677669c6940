"""The stream orders ``moeplace operate --order`` takes (no numpy: the CLI reads them to build its parser)."""

ORDERS = ("table", "dataset", "domain")  # orders of one trace's requests (moeplace.operate.streams.trace_stream)
STREAM_ORDERS = (*ORDERS, "drift", "schedule")  # every --order (moeplace.operate.service.build_stream)
