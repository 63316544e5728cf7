"""kvbench: honest KV-cache compression benchmarks on a real cache."""

__version__ = "0.1.0"
# Bump when a change can move any reported number. 2: compression over several windows or needle
# cases is all reference bytes over all stored bytes (it was a mean of per-case ratios).
PROTOCOL_VERSION = 2
