"""Storage backends. ``base`` defines the interface, ``readers`` the seekable files read through it; each
other module is one storage."""

from .base import Backend, ObjectInfo, Writer

__all__ = ["Backend", "ObjectInfo", "Writer"]
