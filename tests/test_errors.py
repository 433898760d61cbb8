"""The exception family survives pickling and copying with its class, errno, message, URI and notes.

torch's DCP ships each rank's exception to the others by pickling it, so an error that cannot be
rebuilt from its pickle turns every rank's failure into a ``TypeError``. Every ``CkptioError``
subclass in the package is found by walking its modules, so a new class is covered without
editing this file.
"""

from __future__ import annotations

import copy
import errno
import importlib
import inspect
import pickle
import pkgutil

import pytest

import ckptio
from ckptio.errors import AlreadyExistsError, CkptioError, NotFoundError

URI = "s3://bucket/run7/.metadata"


class DefinedElsewhere(NotFoundError):
    """A subclass outside the package with its own signature, as a plugin might define."""

    def __init__(self, bucket: str, key: str, *, hint: str = "check the bucket") -> None:
        super().__init__(f"s3://{bucket}/{key}", f"gone ({hint})")
        self.bucket, self.key, self.hint = bucket, key, hint


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def package_errors() -> list[type]:
    for mod in pkgutil.walk_packages(ckptio.__path__, "ckptio."):
        importlib.import_module(mod.name)
    found = {CkptioError} | _all_subclasses(CkptioError)
    return sorted(
        (c for c in found if c.__module__.startswith("ckptio")), key=lambda c: f"{c.__module__}.{c.__qualname__}"
    )


ERRORS = package_errors()


def test_the_walk_finds_errors_outside_errors_py():
    from ckptio.distributed import DistributedTimeoutError, RankFailedError

    assert {CkptioError, NotFoundError, AlreadyExistsError, RankFailedError, DistributedTimeoutError} <= set(ERRORS)
    assert DefinedElsewhere not in ERRORS  # only the package's own: the plugin-style class is tested below


def make(cls: type) -> BaseException:
    """An instance built the way ckptio builds it: ``cls(uri, detail)`` or ``cls(message)``."""
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if params and params[0].name == "uri":
        return cls(URI, f"{cls.__name__} detail")
    if params and all(p.default is p.empty for p in params):  # a future signature: a string for each
        return cls(*(f"{p.name}-value" for p in params))
    return cls(f"{cls.__name__}: something went wrong with {URI}")


def same(a: BaseException, b: BaseException) -> None:
    assert type(b) is type(a)
    assert str(b) == str(a) and b.args == a.args
    assert vars(b) == vars(a)  # uri, notes and whatever a subclass stores
    for attr in ("errno", "strerror", "filename", "name", "path"):
        assert getattr(b, attr, None) == getattr(a, attr, None), attr


ROUND_TRIPS = {
    **{
        f"pickle{p}": (lambda e, p=p: pickle.loads(pickle.dumps(e, protocol=p)))
        for p in range(pickle.HIGHEST_PROTOCOL + 1)
    },
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__qualname__)
def test_every_error_round_trips(cls, how):
    e = make(cls)
    e.__notes__ = [f"ckptio.dcp: save of {URI} failed on rank 1"]  # what add_note (3.11+) does
    back = ROUND_TRIPS[how](e)
    same(e, back)
    assert back is not e


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_uri_errors_keep_errno_uri_and_message(how):
    for e, code in [
        (ckptio.AlreadyExistsError("/x/.metadata", "exists"), errno.EEXIST),
        (ckptio.NotFoundError("/x/__1_0.distcp"), errno.ENOENT),
        (ckptio.AccessDeniedError("gs://b/k"), errno.EACCES),
        (ckptio.CredentialsError("s3://b/k", "no credentials found"), errno.EACCES),
    ]:
        back = ROUND_TRIPS[how](e)
        assert (type(back), back.errno, back.uri, back.filename, str(back)) == (type(e), code, e.uri, e.uri, str(e))
        assert isinstance(back, OSError) and e.uri in str(back)


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_a_subclass_with_its_own_signature_round_trips(how):
    e = DefinedElsewhere("b", "k/x.bin", hint="ask ops")
    back = ROUND_TRIPS[how](e)
    same(e, back)
    assert (back.bucket, back.key, back.hint, back.uri) == ("b", "k/x.bin", "ask ops", "s3://b/k/x.bin")


def test_missing_dependency_keeps_import_error_fields():
    e = ckptio.MissingDependencyError("'s3' needs s3fs; run: pip install 'ckptio[s3]'", name="s3fs")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.name, str(back)) == (type(e), "s3fs", str(e))


def test_cause_is_not_needed_to_unpickle():
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise AlreadyExistsError(URI) from inner
    except AlreadyExistsError as e:
        back = pickle.loads(pickle.dumps(e))
    assert type(back) is AlreadyExistsError and back.uri == URI
