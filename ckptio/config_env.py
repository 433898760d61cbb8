"""Backend options from the environment: ``CKPTIO_<BACKEND>_<OPTION>=value`` (``CKPTIO_S3_ENDPOINT_URL``).

The option name is the rest of the variable's name, lowercased; ``CKPTIO_CONFIG`` (the settings file) and
variables naming no backend are not options. :func:`ckptio.config.from_env` checks each variable on its own:
an option the backend does not take, or a value of the wrong type, is a SettingsError naming the variable
(:func:`unknown_option` suggests the closest of the backend's variables) and its value unless the option
holds a secret.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping

from .errors import SettingsError

ENV_CONFIG = "CKPTIO_CONFIG"


def variables(env: Mapping[str, str], backend_names: Iterable[str]) -> Iterator[tuple[str, str, str, str]]:
    """``(variable, backend name, option, value)`` of each ``CKPTIO_<BACKEND>_<OPTION>`` in ``env``."""
    names = sorted(backend_names, key=len, reverse=True)
    for key, value in env.items():
        if not key.startswith("CKPTIO_") or key == ENV_CONFIG:
            continue
        rest = key[len("CKPTIO_") :].lower()
        name = next((n for n in names if rest.startswith(n + "_")), None)
        if name is not None:
            yield key, name, rest[len(name) + 1 :], value


def unknown_option(key: str, backend: str, option: str, accepted: Iterable[str]) -> SettingsError:
    """The error for variable ``key`` setting ``option``, which the backend named ``backend`` does not take."""
    prefix = key[: len(key) - len(option)]
    names = sorted(o.upper() for o in accepted)
    close = difflib.get_close_matches(key, [prefix + n for n in names], n=1, cutoff=0.5)
    return SettingsError(
        f"environment variable {key}: the {backend!r} backend has no option {option!r}"
        f"{f'; did you mean {close[0]!r}?' if close else ''} (its variables are {prefix}<OPTION> for OPTION in "
        f"{', '.join(names)})"
    )
