"""The runtime layer: the native core reached through cffi, and the objects users drive.

``_bindings`` (the cffi library and the one place C status codes become exceptions) and
``_handle`` (the lifetime of every native handle) sit at the bottom; ``target``, ``drafter``,
``scheduler`` (the stepped native loop) and ``engine`` (target + drafter through the scheduler)
on top, with ``generation`` (options, results), ``chat`` (templates, JSON schema), ``devices``,
``kernels`` and ``tuning_cache`` beside them. Importing this package loads nothing native.
"""
