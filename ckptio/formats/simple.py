"""Small built-in formats: text, bytes, json, yaml, pickle, msgpack, numpy."""

from __future__ import annotations

import io
import json
import pickle
from typing import IO, Any

from ..errors import FormatError, MissingDependencyError
from .base import StreamFormat


class TextFormat(StreamFormat):
    def dump_file(self, obj: Any, f: IO, *, encoding: str = "utf-8", **kw: Any) -> None:
        if not isinstance(obj, str):
            raise TypeError(f"the txt format writes str, got {type(obj).__name__}")
        f.write(obj.encode(encoding) if _is_binary(f) else obj)

    def load_file(self, f: IO, *, encoding: str = "utf-8", **kw: Any) -> str:
        data = f.read()
        return data.decode(encoding) if isinstance(data, (bytes, bytearray)) else data


class BytesFormat(StreamFormat):
    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        if not isinstance(obj, (bytes, bytearray, memoryview)):
            raise TypeError(f"the bytes format writes bytes-like objects, got {type(obj).__name__}")
        f.write(obj)

    def load_file(self, f: IO, **kw: Any) -> bytes:
        return f.read()


class JsonFormat(StreamFormat):
    load_options = frozenset(
        {"cls", "object_hook", "parse_float", "parse_int", "parse_constant", "object_pairs_hook", "strict"}
    )
    dump_options = frozenset(
        {"durable", "skipkeys", "ensure_ascii", "check_circular", "allow_nan", "cls", "indent", "separators"}
        | {"default", "sort_keys"}
    )
    open_with = frozenset({"cls"})  # a decoder or encoder class of the caller's takes its own keywords

    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        text = json.dumps(obj, **kw)  # TypeError for non-serializable objects, before anything is written
        f.write(text.encode("utf-8") if _is_binary(f) else text)

    def load_file(self, f: IO, **kw: Any) -> Any:
        try:
            return json.load(f, **kw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"not valid JSON ({e})") from None


class YamlFormat(StreamFormat):
    @staticmethod
    def _yaml() -> Any:
        try:
            import yaml
        except ImportError as e:
            raise MissingDependencyError("the yaml format needs PyYAML: pip install 'ckptio[yaml]'") from e
        return yaml

    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        yaml = self._yaml()
        text = yaml.safe_dump(obj, **kw)
        f.write(text.encode("utf-8") if _is_binary(f) else text)

    def load_file(self, f: IO, **kw: Any) -> Any:
        return self._yaml().safe_load(f)  # safe: never constructs arbitrary Python objects


class PickleFormat(StreamFormat):
    """Plain pickle on write. Loading admits only plain data and runs no code (see
    :mod:`ckptio.formats.safepickle`); ``allow_pickle=True`` loads trusted files with plain pickle."""

    load_options = frozenset({"allow_pickle", "encoding", "errors", "fix_imports", "buffers"})
    dump_options = frozenset({"durable", "protocol", "fix_imports", "buffer_callback"})

    def dump_file(self, obj: Any, f: IO, *, protocol: int = pickle.HIGHEST_PROTOCOL, **kw: Any) -> None:
        f.write(pickle.dumps(obj, protocol=protocol, **kw))

    def load_file(self, f: IO, *, allow_pickle: bool = False, **kw: Any) -> Any:
        if allow_pickle:
            return pickle.load(f, **kw)
        from . import safepickle

        return safepickle.load(f, **kw)


class MsgpackFormat(StreamFormat):
    load_options = frozenset(
        {"object_hook", "list_hook", "use_list", "raw", "timestamp", "strict_map_key", "unicode_errors"}
        | {"object_pairs_hook", "ext_hook", "max_str_len", "max_bin_len", "max_array_len", "max_map_len", "max_ext_len"}
    )
    dump_options = frozenset(
        {"durable", "default", "unicode_errors", "use_single_float", "strict_types", "datetime", "autoreset"}
        | {"buf_size"}
    )

    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        import msgpack

        f.write(msgpack.packb(obj, use_bin_type=True, **kw))

    def load_file(self, f: IO, **kw: Any) -> Any:
        import msgpack

        kw.setdefault("raw", False)
        kw.setdefault("strict_map_key", False)
        try:
            return msgpack.unpackb(f.read(), **kw)
        except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError) as e:
            raise FormatError(f"not valid msgpack ({e})") from None


class NumpyFormat(StreamFormat):
    load_options = frozenset({"mmap_mode", "allow_pickle", "fix_imports", "encoding", "max_header_size"})
    dump_options = frozenset({"durable", "fix_imports"})

    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        import numpy as np

        if not isinstance(obj, np.ndarray):
            raise TypeError(f"the npy format writes numpy arrays, got {type(obj).__name__}")
        np.save(f, obj, allow_pickle=False, **kw)

    def load_file(self, f: IO, **kw: Any) -> Any:
        import numpy as np

        kw.setdefault("allow_pickle", False)
        if not hasattr(f, "seekable") or not f.seekable():
            f = io.BytesIO(f.read())
        return np.load(f, **kw)


def _is_binary(f: IO) -> bool:
    """Whether ``f`` takes bytes: io's binary classes do, its text classes don't, and a wrapper that
    is neither (tempfile's ``NamedTemporaryFile``, ``SpooledTemporaryFile``) says so by its ``mode``
    (``"r+"``: text, ``"w+b"``: binary) or, lacking a str mode, by having a str ``encoding``."""
    if isinstance(f, io.TextIOBase):
        return False
    if isinstance(f, (io.BufferedIOBase, io.RawIOBase)):
        return True
    mode = getattr(f, "mode", None)
    if isinstance(mode, str):
        return "b" in mode
    return not isinstance(getattr(f, "encoding", None), str)
