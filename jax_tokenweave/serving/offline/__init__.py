"""The offline API: ``LLM`` (``llm``; what it builds from its arguments: ``llm_setup``;
what it derives from the checkpoint: ``resolve``), the prompt forms it takes (``prompts``)
and ``generate_ids`` (``oneshot``). See docs/SERVING.md#servingoffline.
"""
