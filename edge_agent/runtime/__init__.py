"""Model runtime: GGUF reading, prepared weights pinned in memory, tokenizer, numpy llama.

Never imports asyncio, sockets, serial or SQLite (ARCHITECTURE.md, rooms).
"""
