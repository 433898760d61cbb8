"""Storage backends. ``base`` defines the interface; each other module is one storage."""

from .base import Backend, ObjectInfo, Writer

__all__ = ["Backend", "ObjectInfo", "Writer"]
