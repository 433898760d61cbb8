"""ckptio: fast, safe checkpoint I/O for PyTorch on any storage."""

from . import errors
from .backends.base import Backend, ObjectInfo, Writer
from .context import Context, configure, reset, resolve, settings
from .registry import register_backend, register_format

__version__ = "0.1.0"
