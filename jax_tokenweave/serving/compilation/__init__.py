"""The step programs kept across engines: JAX's persistent compilation cache
(``compilation_cache``), finished executables on disk (``executable_cache``; their key:
``executable_key``) and the count of compilations (``compile_count``). See
docs/SERVING.md#servingcompilation.
"""
