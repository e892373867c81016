"""Loopback HTTP helpers for tests that start a real server (shared with ``pydflash bench``)."""

from pydflash._upstream import free_port, post_json, wait_healthy  # noqa: F401
