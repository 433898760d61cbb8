"""Incremental storage: a block that is already stored under a root is never written twice.

Layout under a root (a Checkpointer's ``root_uri`` with ``incremental=True``)::

    root/.content/<2 hex>/<32 hex>   a content object: one block of bytes, named by its 128-bit xxh3
                                     (``xxhash.xxh3_128``, lowercase hex); the first two digits shard it
    root/<step>/state.fpk            a recipe (:mod:`.recipe`) where the data file would be: the logical
                                     size and the blocks, in order, that make up the file's bytes

- :mod:`.recipe`: the recipe's bytes, parsed strictly (hashes are 32 lowercase hex digits, lengths
  positive and summing to the size, counts bounded), so no path from metadata leaves ``.content``.
- :mod:`.store`: :class:`BlockStore`, the content objects: which are known (referenced by committed
  steps, or written by the save in progress), writing one (``mode="create"``: an existing object
  already holds the same bytes), reading one into a caller's buffer with its hash checked, and the
  sweep of content no step references, only once it is older than a grace period.
- :mod:`.backend`: :class:`IncrementalBackend`, a backend wrapper whose writers cut the byte stream
  into blocks (where a large write call starts, at payload boundaries a format marks with
  ``Writer.mark_boundary`` once a block has ``min_block`` bytes, at most ``max_block`` bytes), write
  the unknown ones and on close the recipe; its reads see the logical bytes.

- :mod:`.direct`: reading one step's data file (or DCP directory) by its URI, through the
  ``.content`` of the step directory's parent.

Safety: a content object is durable (its writer closed) before the recipe that names it is written,
and the recipe before the commit marker of its step. Only content referenced by a committed step (or
written by the running save) is reused, and the sweep deletes only what no committed step references
and is older than the grace period, so it never deletes a block a save in progress wrote.

One writer per root: blocks are create-only and named by their hash, so concurrent writers never
conflict on one, the grace period keeps a sweep off another saver's fresh blocks, and a save's
cleanup leaves another saver's step in progress alone (:mod:`ckptio.checkpointer.retention`); but a
save skips blocks committed steps reference, and a second writer's retention could delete those steps
and sweep their old blocks mid-save, leaving the save's step with missing content (its load fails
with ``IntegrityError``). ``Checkpointer.content_grace`` (default one hour) is the grace period;
``ckptio du ROOT`` (:func:`ckptio.checkpointer.usage`) reports logical, own and physical bytes.
"""

from __future__ import annotations

from .backend import IncrementalBackend
from .recipe import MAGIC, Recipe, pack_recipe, parse_recipe
from .store import CONTENT_DIR, BlockStore

__all__ = ["BlockStore", "CONTENT_DIR", "IncrementalBackend", "MAGIC", "Recipe", "pack_recipe", "parse_recipe"]
