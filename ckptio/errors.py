"""One exception family. Each subclasses the built-in a caller would naturally catch.

Backends translate their client's errors into these at the boundary, so user code can write
``except FileNotFoundError`` whatever the storage. Every message names the URI involved.

Every error pickles and copies with its class, ``args`` (errno, message, URI) and attributes
(``uri``, notes): torch's DCP ships a rank's exception to the others by pickling it. The default
rebuilds an exception by calling ``cls(*args)``, which the ``(uri, detail)`` signatures below do not
accept; :meth:`CkptioError.__reduce__` rebuilds through the built-in base's ``__init__`` instead, so
a subclass anywhere (with any signature) is covered.

No error carries a secret: :func:`redact` masks the credentials a URL may hold (``user:password@``, a
query string such as a presigned ``X-Amz-Signature``) in every message, argument, ``uri`` attribute
and note, when the error is made. It is the one redaction: settings, the CLI's output and log lines
use it too.
"""

from __future__ import annotations

import errno as _errno
import logging
import re
from typing import Any

REDACTED = "***"
# in any text: the userinfo of a URL (to the last @ before its path) and its query string
_USERINFO = re.compile(r"(?i)(^|\b[a-z][a-z0-9+.\-]*://)[^/?#\s'\"]+@")
_QUERY = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^?#\s'\"]*\?)[^#\s'\"]+")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it masked: ``https://***@host/p?***``."""
    if "@" not in text and "?" not in text:
        return text
    return _QUERY.sub(rf"\1{REDACTED}", _USERINFO.sub(rf"\1{REDACTED}@", text))


class _RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = redact(text)
        if clean != text:
            record.msg, record.args = clean, None
        return True


_FILTER = _RedactingFilter()


def logger(name: str) -> logging.Logger:
    """The logger ``name``, its lines redacted (:func:`redact`): every ckptio module logs through one."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


class Redacting:
    """Mixin for exceptions and warnings: string arguments and attributes (``uri``) are redacted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # kwargs: ImportError's name, path
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args), **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, redact(value) if isinstance(value, str) else value)


def note(e: BaseException, text: str) -> None:
    """Attach ``text`` to ``e`` as a note (shown under its traceback; PEP 678), without changing its type."""
    text = redact(text)
    if hasattr(e, "add_note"):
        e.add_note(text)
    else:  # Python 3.10
        e.__notes__ = [*getattr(e, "__notes__", []), text]  # type: ignore[attr-defined]


def replaced(uri: str, pinned: str, seen: str | None = None) -> IntegrityError:
    """The error for an object replaced while one load read it in several calls (``Backend.pin_version``)."""
    now = f", then {seen}" if seen else ""
    return IntegrityError(
        f"{uri} was replaced while it was being read (version {pinned}{now}); nothing read from it "
        f"was used: read it again"
    )


def _rebuild(cls: type[BaseException], args: tuple) -> BaseException:
    """Unpickle ``cls`` from its built-in base's ``args``, without calling ``cls.__init__``."""
    obj = cls.__new__(cls, *args)
    builtin = next(k for k in cls.__mro__ if k.__module__ == "builtins" and issubclass(k, BaseException))
    builtin.__init__(obj, *args)  # OSError: sets errno, strerror, filename from args
    return obj


class CkptioError(Redacting, Exception):
    """Base class of every error ckptio raises on purpose."""

    def __reduce__(self) -> str | tuple[Any, ...]:
        reduced = super().__reduce__()  # the built-in's: OSError puts the filename back in args
        if isinstance(reduced, str):  # a global's name (never for the built-in exceptions): as it is
            return reduced
        cls, args, *state = reduced
        return (_rebuild, (cls, args), *state)  # state: __dict__ (uri, __notes__), ImportError's name/path


class NotFoundError(CkptioError, FileNotFoundError):
    def __init__(self, uri: str, detail: str = "no such object") -> None:
        super().__init__(_errno.ENOENT, f"{detail}: {uri}", uri)
        self.uri = uri

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class AlreadyExistsError(CkptioError, FileExistsError):
    def __init__(self, uri: str, detail: str = "object already exists (write mode 'create')") -> None:
        super().__init__(_errno.EEXIST, f"{detail}: {uri}", uri)
        self.uri = uri

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class AccessDeniedError(CkptioError, PermissionError):
    def __init__(self, uri: str, detail: str = "permission denied") -> None:
        super().__init__(_errno.EACCES, f"{detail}: {uri}", uri)
        self.uri = uri

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class CredentialsError(AccessDeniedError):
    """No usable credentials were found, or the server rejected them."""


class UnknownSchemeError(CkptioError, ValueError):
    """The URI's scheme matches no registered backend and no alias."""


class InvalidURIError(CkptioError, ValueError):
    """The URI is malformed (e.g. ``s3://`` with no bucket)."""


class MissingDependencyError(CkptioError, ImportError):
    """An optional package is needed; the message says which extra to install."""


class SettingsError(CkptioError, ValueError):
    """Settings are invalid; the message names the source, the key and the reason."""


class UnsafeKeyError(CkptioError, ValueError):
    """A listed key would leave the directory it was listed under (``../``, absolute): the storage holds
    crafted or corrupt names. Nothing is copied."""


class FormatError(CkptioError, ValueError):
    """A file cannot be decoded by the format chosen for it (wrong type, malformed, unsupported)."""


class UnknownFormatError(FormatError):
    """No format is registered for a file's extension."""


class UnsupportedValueError(CkptioError, TypeError, ValueError):
    """``dump`` cannot store a value in the format asked for; nothing was written. A TypeError, as every
    format's ``dump`` raises, and a ValueError, as ``safetensors.torch.save_file`` raises for the same values."""


class UnknownOptionError(CkptioError, TypeError):
    """A call got a keyword argument that neither it nor the format of its file takes (the TypeError Python
    raises, naming the public call, its options and the closest one)."""


class UnsupportedTensorError(UnsupportedValueError, NotImplementedError):
    """A tensor whose memory the format cannot represent: tensors sharing memory, a meta tensor. Also a
    RuntimeError / NotImplementedError, what ``safetensors.torch.save_file`` raises for them."""


class IntegrityError(FormatError):
    """Stored bytes do not match their checksum, or a file is truncated or has trailing bytes."""


class IncompleteCheckpointError(CkptioError, FileNotFoundError):
    """A checkpoint directory exists but was never committed (its commit marker is missing)."""


class TransferError(CkptioError, OSError):
    """A remote operation failed for a reason that is not one of the above."""


class TierInUseError(AlreadyExistsError):
    """A Checkpointer's ``local_tier`` already serves another root (its ``tier.json`` names that root)."""


class IsDirectoryError(CkptioError, IsADirectoryError):
    """A file was expected where there is a directory (or a prefix with objects under it)."""


class NotDirectoryError(CkptioError, NotADirectoryError):
    """A directory was expected where there is a file (or a path goes through a file)."""


class StateMismatchError(CkptioError, RuntimeError, ValueError):
    """A checkpoint cannot be restored into the state given to ``load``: tensors of other shapes, an optimizer
    whose groups cannot be matched. Nothing was restored. A RuntimeError, as torch's ``load_state_dict``
    raises for a size mismatch, and a ValueError, as an optimizer's ``load_state_dict`` raises for its groups."""
