"""Serialization formats, chosen by file extension (see ckptio.registry)."""
