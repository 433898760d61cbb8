"""ckptio: fast, safe checkpoint I/O for PyTorch on any storage.

``ckptio.dump(obj, uri)`` / ``ckptio.load(uri)`` choose the storage by the URI's scheme and the
format by the file's extension; the rest of the easy_io surface (put/get/exists/ls/copy...) works
on every backend. ``ckptio.Checkpointer(root, incremental=True)`` keeps numbered checkpoints whose
unchanged tensors are stored once (:mod:`ckptio.incremental`: one writer per root, the
``content_grace`` period, ``ckptio du``). See the README for the tour.
"""

from . import errors
from .backends.base import Backend, ObjectInfo, Writer
from .context import Context, configure, reset, resolve, settings
from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CkptioError,
    CredentialsError,
    FormatError,
    IntegrityError,
    MissingDependencyError,
    NotFoundError,
    SettingsError,
    UnknownFormatError,
    UnknownSchemeError,
)
from .formats.base import Format, StreamFormat
from .inspect import info, verify
from .io import (
    copy_if_symlink_fails,
    copyfile,
    copyfile_from_local,
    copyfile_to_local,
    copytree,
    copytree_from_local,
    copytree_to_local,
    dump,
    exists,
    get,
    get_local_path,
    get_text,
    isdir,
    isfile,
    join_path,
    list_dir_or_file,
    load,
    ls,
    open,
    put,
    put_text,
    readinto,
    remove,
    rmtree,
    set_s3_backend,
    stat,
)
from .registry import register_backend, register_format

__version__ = "0.1.0"


_LAZY_MODULES = ("fastpickle", "dcp", "distributed", "checkpointer", "cli", "progress", "restore")


def __getattr__(name: str):  # lazy: these import torch (and torch.distributed); ``import ckptio`` does not
    if name == "Checkpointer":
        from .checkpointer import Checkpointer

        return Checkpointer
    if name == "RNGState":
        from .checkpointer import RNGState

        return RNGState
    if name == "load_into":
        from .restore import load_into

        return load_into
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ckptio' has no attribute {name!r}")


__all__ = [
    "AccessDeniedError",
    "AlreadyExistsError",
    "Backend",
    "Checkpointer",
    "RNGState",
    "CkptioError",
    "Context",
    "CredentialsError",
    "Format",
    "FormatError",
    "IntegrityError",
    "MissingDependencyError",
    "NotFoundError",
    "ObjectInfo",
    "SettingsError",
    "StreamFormat",
    "UnknownFormatError",
    "UnknownSchemeError",
    "Writer",
    "configure",
    "copy_if_symlink_fails",
    "copyfile",
    "copyfile_from_local",
    "copyfile_to_local",
    "copytree",
    "copytree_from_local",
    "copytree_to_local",
    "dump",
    "errors",
    "exists",
    "get",
    "get_local_path",
    "get_text",
    "info",
    "isdir",
    "isfile",
    "join_path",
    "list_dir_or_file",
    "load",
    "load_into",
    "ls",
    "open",
    "put",
    "put_text",
    "readinto",
    "register_backend",
    "register_format",
    "remove",
    "reset",
    "resolve",
    "rmtree",
    "set_s3_backend",
    "settings",
    "stat",
    "verify",
]
