"""Compressors: how retained tokens are stored, or which are kept once."""
