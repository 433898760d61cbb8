"""``Checkpointer``: crash-safe, resumable training checkpoints on any ckptio URI (see :mod:`.core`)."""

from .core import *  # noqa: F403
from .core import __all__ as __all__
