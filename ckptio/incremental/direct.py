"""Reading one incremental data file directly (``ckptio.load``, ``ckptio info``/``verify`` on its URI).

A Checkpointer's incremental step keeps a recipe where a data file would be, so the file is
``root/<step>/<name>`` and its content is under ``root/.content``, the step directory's parent: only
that ``.content`` is ever used, and the recipe's block names cannot leave it (:mod:`.recipe`).
"""

from __future__ import annotations

from typing import Any

from .. import uri as _uri
from ..backends.base import Backend
from ..context import resolve
from ..dcp_names import DATA_SUFFIX
from .backend import IncrementalBackend
from .recipe import MAGIC
from .store import CONTENT_DIR, BlockStore


def is_recipe(backend: Backend, uri: str) -> bool:
    """Whether the object at ``uri`` starts with the recipe magic (False when it cannot be read)."""
    try:
        return backend.read_range(uri, 0, len(MAGIC)) == MAGIC
    except (OSError, ValueError):
        return False


def reader_for(backend: Backend, step_dir: str) -> IncrementalBackend:
    """A backend reading the files of the step directory ``step_dir`` (resolved) through its root's content."""
    root = _uri.parent(step_dir.rstrip("/"))
    return IncrementalBackend(backend, BlockStore(backend, _uri.join_path(root, CONTENT_DIR)))


def step_reader(d: str, cache: Any) -> tuple[IncrementalBackend, str]:
    """The backend to read the incremental step directory ``d`` (a URI) through, and ``d`` resolved."""
    backend, resolved = resolve(d, cache=cache)
    return reader_for(backend, resolved), resolved


def file_reader(backend: Backend, uri: str) -> IncrementalBackend | None:
    """For the data file ``uri`` of an incremental step, a backend that reads its logical bytes; else None."""
    return reader_for(backend, _uri.parent(uri)) if is_recipe(backend, uri) else None


def dcp_reader(backend: Backend, d: str) -> IncrementalBackend | None:
    """For the DCP directory ``d`` of an incremental step (its data objects are recipes), a backend that
    reads their logical bytes; else None."""
    try:
        first = next((i.uri for i in backend.list(d) if i.uri.endswith(DATA_SUFFIX) and not i.is_dir), None)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return reader_for(backend, d) if first is not None and is_recipe(backend, first) else None
