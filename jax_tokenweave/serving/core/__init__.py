"""The engine: ``LLMEngine`` (``engine``: the step loop), its request side (``intake``,
``requests``), what each step tells a request (``deltas``) and its counts (``stats``). See
docs/SERVING.md#servingcore.
"""
