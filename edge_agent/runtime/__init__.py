"""Model runtime: GGUF reading, prepared weights pinned in memory, tokenizer, numpy llama.

Never imports asyncio, sockets, serial or SQLite (docs/architecture.md; checked by
tests/test_rooms.py).
"""
