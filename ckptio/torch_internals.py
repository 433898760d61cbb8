"""The private torch names ckptio relies on: the only module that spells them.

torch does not promise to keep these. Each public name here maps to one private torch symbol
(:data:`SYMBOLS`) and is resolved on first use (PEP 562 module ``__getattr__``), so importing this
module imports nothing, and a DCP-only name costs nothing to a caller that never touches DCP. A
symbol a torch release dropped fails on use with an ``AttributeError`` naming the torch symbol
and this module; ``tests/test_torch_internals.py`` resolves every one of them on the installed
torch, so a torch upgrade that moves one fails there first, with its name.

Supported torch: :data:`TORCH_RELEASES`, each release with how the claim is backed; pyproject.toml
declares ``torch>=`` its oldest, with no upper bound (``tests/test_packaging.py`` keeps the two equal):
a cap would make ``pip install ckptio`` replace a newer torch, as a floor above the user's does. A
release outside the table warns once, at first use (:func:`check_torch_version`), and a symbol it
lacks fails on use naming it, or falls back where a caller can do without it (``dcp_logger``:
nothing to quiet; ``StorageReaderTransforms``: only items a torch >= 2.7 writer transformed need it).
The "since" notes below come from torch's history and are not tested here.

Groups:

* **Tensor pickling** (``torch._utils``, ``torch.storage``, ``torch.serialization``): how
  ``torch.save`` pickles a tensor (``_rebuild_tensor_v2``, ``_rebuild_parameter``: torch >= 1.0),
  the storage class name for a dtype (``_dtype_to_storage_type_map``,
  ``_get_dtype_from_pickle_storage_type``: torch >= 2.0, the typed-storage rework), element sizes
  (``_element_size``) and how layouts pickle (``torch.serialization._get_layout``). The string
  constants are what a pickle names, for unpicklers that match names without importing them.
* **Archive reading** (``torch._C.PyTorchFileReader``: torch >= 1.6, the zip format): the reader
  ``torch.load`` itself uses, so ckptio sees an archive exactly as torch does.
* **Quantized tensors** (``torch._make_per_tensor_quantized_tensor``,
  ``torch._make_per_channel_quantized_tensor``: torch >= 1.3): building a quantized tensor from
  its integer representation.
* **DCP** (``torch.distributed.checkpoint``, torch >= 2.0): the storage entry type torch's own
  filesystem reader expects in ``.metadata`` (``filesystem._StorageInfo``), the memory-format enum
  tensor properties pickle (``metadata._MEM_FORMAT_ENCODING``), its stream transforms
  (``_StorageReaderTransforms``: torch >= 2.7), narrowing a stored tensor to a requested box
  (``torch.distributed._shard._utils.narrow_tensor_by_index``), flattening/setting nested state
  dicts as DCP does (``_nested_dict.flatten_state_dict``, ``_traverse.set_element``: torch >= 2.2), the
  names ``get_optimizer_state_dict`` gives a module's parameters (``state_dict._get_fqns``: torch >= 2.2)
  and torch's fsspec writer/reader (``_fsspec_filesystem``: torch >= 2.2, benchmarks only); the
  logger torch's DCP API sends its debug records to (``logger._dcp_logger``), whose
  records :mod:`ckptio.dcp.quiet` skips while nothing receives them.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = [
    "LAYOUT_GLOBAL",
    "REBUILD_MODULE",
    "REBUILD_PARAMETER",
    "REBUILD_QTENSOR",
    "REBUILD_TENSOR",
    "SYMBOLS",
    "TESTED_TORCH",
    "TORCH_RELEASES",
    "check_torch_version",
    "resolve_symbol",
]

# major.minor -> how ckptio's support of it is backed (the oldest is pyproject.toml's floor)
TORCH_RELEASES: dict[str, str] = {
    "2.13": "tested: the whole suite, in CI (requirements/dev.txt pins 2.13.0)",
    "2.14": "tested by hand, not in CI: test_torch_internals.py and the DCP, Checkpointer, remote .pt tests (2.14.1)",
}
TESTED_TORCH = tuple(TORCH_RELEASES)  # every release the table claims has been run

# Names as a pickle spells them (module, qualified name): matched, never imported, by unpicklers.
REBUILD_MODULE = "torch._utils"
REBUILD_TENSOR = "_rebuild_tensor_v2"
REBUILD_PARAMETER = "_rebuild_parameter"
REBUILD_QTENSOR = "_rebuild_qtensor"  # allocates its size argument before it sets the storage
LAYOUT_GLOBAL = ("torch.serialization", "_get_layout")  # how a torch.layout pickles

# public name here -> (torch module, attribute path in it)
SYMBOLS: dict[str, tuple[str, str]] = {
    # tensor pickling
    "rebuild_tensor_v2": (REBUILD_MODULE, REBUILD_TENSOR),
    "rebuild_parameter": (REBUILD_MODULE, REBUILD_PARAMETER),
    "element_size": ("torch._utils", "_element_size"),
    "dtype_to_storage_type_map": ("torch.storage", "_dtype_to_storage_type_map"),
    "get_dtype_from_pickle_storage_type": ("torch.storage", "_get_dtype_from_pickle_storage_type"),
    "get_layout": LAYOUT_GLOBAL,
    # archive reading
    "PyTorchFileReader": ("torch._C", "PyTorchFileReader"),
    # quantized tensors
    "make_per_tensor_quantized_tensor": ("torch", "_make_per_tensor_quantized_tensor"),
    "make_per_channel_quantized_tensor": ("torch", "_make_per_channel_quantized_tensor"),
    # DCP
    "StorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    "MEM_FORMAT_ENCODING": ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    "StorageReaderTransforms": ("torch.distributed.checkpoint.filesystem", "_StorageReaderTransforms"),
    "narrow_tensor_by_index": ("torch.distributed._shard._utils", "narrow_tensor_by_index"),
    "flatten_state_dict": ("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    "set_element": ("torch.distributed.checkpoint._traverse", "set_element"),
    "get_fqns": ("torch.distributed.checkpoint.state_dict", "_get_fqns"),
    "FsspecWriter": ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),
    "FsspecReader": ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader"),
    "dcp_logger": ("torch.distributed.checkpoint.logger", "_dcp_logger"),
}

_checked = False


def resolve_symbol(name: str) -> Any:
    """The torch object behind ``name`` (a key of :data:`SYMBOLS`); ``AttributeError`` naming it if torch lacks it."""
    module, attr = SYMBOLS[name]
    check_torch_version()
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        import torch

        raise AttributeError(
            f"ckptio needs {module}.{attr} (ckptio.torch_internals.{name}), which torch {torch.__version__} "
            f"does not have ({type(e).__name__}: {e}); ckptio is tested with torch {', '.join(TESTED_TORCH)}"
        ) from e
    return obj


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    """Warn once when the installed torch is not a release of :data:`TORCH_RELEASES` (private names may differ)."""
    global _checked
    if _checked:
        return
    _checked = True
    import torch

    release = "{}.{}".format(*_minor(torch.__version__))
    if release in TESTED_TORCH:
        return
    oldest = min(TESTED_TORCH, key=_minor)
    if _minor(release) < _minor(oldest):
        why = f"older than {oldest}, the oldest release ckptio supports"
    else:
        why = "a release ckptio has not been tested with yet"
    warnings.warn(
        f"ckptio is tested with torch {', '.join(TESTED_TORCH)}, not {torch.__version__} ({why}): it relies on "
        f"private torch names (ckptio/torch_internals.py) that may have changed; run tests/test_torch_internals.py",
        RuntimeWarning,
        stacklevel=3,
    )


def __getattr__(name: str) -> Any:
    if name not in SYMBOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    obj = resolve_symbol(name)
    globals()[name] = obj  # later lookups are plain module attributes
    return obj
