"""The object names of a torch DCP checkpoint directory, importable without torch (``ckptio info``,
the Checkpointer's catalog and the incremental reader tell a DCP directory by them)."""

METADATA_NAME = ".metadata"  # the commit marker: pickled ``Metadata``, written last
DATA_SUFFIX = ".distcp"  # each data object: ``__<rank>_<n>[.<attempt>].distcp``
