"""kvbench: honest KV-cache compression benchmarks on a real cache."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1  # bump when a change can move any reported number
