"""The host side of continuous batching (pure Python): the scheduler (``scheduler``), a
request's state (``request_state``), its KV blocks on demand and the prefix cache
(``prefix_cache``) over the block allocator (``blocks``). See docs/SERVING.md#servingscheduling.
"""
