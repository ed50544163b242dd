"""The device side of the engine: ``ModelRunner`` (``runner``), the step's packed layout
(``batch``), its forward program (``step``; inputs at fixed addresses: ``step_io``), the
sampler programs (``sampler``), warm-up (``warmup``) and the device memory (``memory``). See
docs/SERVING.md#servingrunner.
"""
