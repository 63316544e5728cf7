"""Corpora and tasks: the text a benchmark cell is scored on."""

from kvbench.data.corpus import describe_source, load_text, validate

__all__ = ["describe_source", "load_text", "validate"]
