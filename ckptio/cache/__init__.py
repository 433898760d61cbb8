"""The node-local cache: a backend that wraps a backend and serves whole-object reads from files on
this node, verified on every read.

- :mod:`.store`: the directory layout, locking protocol, fills, pins and eviction (:class:`CacheStore`);
- :mod:`.eviction`: least-recently-used eviction down to ``max_bytes``, and ``clear``;
- :mod:`.entries`: an entry's files, block checksums, verified reads and the directory scan;
- :mod:`.locks`: the ``flock``-based file lock that survives an evictor unlinking its file;
- :mod:`.backend`: :class:`CachedBackend`, the wrapper;
- :mod:`.settings`: ``cache=`` arguments, the settings file's ``[cache]`` table and the default directory.
"""

from .backend import CachedBackend
from .entries import usage
from .settings import ENV_CACHE_DIR, default_cache_dir
from .store import CacheStats, CacheStore

__all__ = ["ENV_CACHE_DIR", "CacheStats", "CacheStore", "CachedBackend", "default_cache_dir", "usage"]
