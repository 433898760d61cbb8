"""Backend wrappers that are not storages: :mod:`.forwarding` (their base), :mod:`.counting` (bytes
moved, for ``progress=``).
The node-local cache, also a wrapper, is its own package, :mod:`ckptio.cache`."""
