"""``ckptio.fastpickle``: the public face of the ``.fpk`` format, kept at its original import path.

A re-export, no code: the implementation lives in the package :mod:`ckptio.formats.fastpickle` (byte
layout and its constants in :mod:`ckptio.formats.fastpickle.layout`). It stays because docs/formats.md
documents ``ckptio.fastpickle.inspect/load/save`` and programs that craft or check ``.fpk`` bytes
import the layout constants from here; new code inside ckptio imports from ``formats.fastpickle``.
"""

from .errors import FormatError, IntegrityError
from .formats.fastpickle import FastpickleFormat, Inspection, PickledObject, TensorInfo, inspect, load, save
from .formats.fastpickle.layout import (
    ALIGN,
    EXT_BIGINT,
    EXT_COMPLEX,
    EXT_DEVICE,
    EXT_DTYPE,
    EXT_FROZENSET,
    EXT_GDICT,
    EXT_NPDTYPE,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_PICKLE,
    EXT_SET,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    FLAG_PICKLE,
    FOOTER,
    FOOTER_MAGIC,
    HEADER,
    KIND_NUMPY,
    KIND_QUANT,
    KIND_TORCH,
    MAGIC,
    MAX_DEPTH,
    MAX_NDIM,
    TF_PARAMETER,
    TF_REQUIRES_GRAD,
    VERSION,
)
from .formats.fastpickle.read import TAIL_PREFETCH

__all__ = [
    "save",
    "load",
    "inspect",
    "FastpickleFormat",
    "Inspection",
    "TensorInfo",
    "PickledObject",
    "FormatError",
    "IntegrityError",
    "ALIGN",
    "EXT_BIGINT",
    "EXT_COMPLEX",
    "EXT_DEVICE",
    "EXT_DTYPE",
    "EXT_FROZENSET",
    "EXT_GDICT",
    "EXT_NPDTYPE",
    "EXT_NPSCALAR",
    "EXT_ODICT",
    "EXT_PICKLE",
    "EXT_SET",
    "EXT_SIZE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "FLAG_PICKLE",
    "FOOTER",
    "FOOTER_MAGIC",
    "HEADER",
    "KIND_NUMPY",
    "KIND_QUANT",
    "KIND_TORCH",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_NDIM",
    "TF_PARAMETER",
    "TF_REQUIRES_GRAD",
    "VERSION",
    "TAIL_PREFETCH",
]
