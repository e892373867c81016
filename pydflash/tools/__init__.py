"""Measurement tools built on the runtime: ``pydflash bench`` / ``profile`` and upstream comparisons.

``bench`` (plain vs speculative, ours and llama-server's), ``profiler`` and ``autotune`` (choosing
n_max from measured costs), ``upstream_binaries`` (the llama.cpp tools shipped in the wheel and
their console scripts), ``upstream_server`` (running that llama-server on loopback).
"""
