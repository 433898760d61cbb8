"""Backend options from the environment: ``CKPTIO_<BACKEND>_<OPTION>=value`` (``CKPTIO_S3_ENDPOINT_URL``).

The option name is the rest of the variable's name, lowercased. Each variable is checked on its own as it
is read: an option the backend does not take, or a value of the wrong type, is a SettingsError naming the
variable (with a did-you-mean among the variables the backend takes) and its value unless the option
holds a secret. ``CKPTIO_CONFIG`` (the settings file) and variables naming no backend are not options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import registry as _registry
from .config import ENV_CONFIG, Settings, _did_you_mean, accepted_options, coerce_option, from_mapping
from .errors import SettingsError


def from_env(env: Mapping[str, str], backend_names: list[str]) -> Settings:
    """The ``environment`` layer of the settings: options for the backends named in ``backend_names``."""
    backends: dict[str, dict[str, Any]] = {}
    names = sorted(backend_names, key=len, reverse=True)
    for key, value in env.items():
        if not key.startswith("CKPTIO_") or key == ENV_CONFIG:
            continue
        rest = key[len("CKPTIO_") :].lower()
        name = next((n for n in names if rest.startswith(n + "_")), None)
        if name is not None:
            option = rest[len(name) + 1 :]
            _check(key, name, option)
            coerce_option(option, value, f"environment variable {key}")
            backends.setdefault(name, {})[option] = value
    return from_mapping({"backends": backends}, "environment") if backends else Settings(sources=())


def _check(key: str, name: str, option: str) -> None:
    entry = _registry.backends.by_name(name)
    accepted = accepted_options(entry) if entry is not None else None
    if entry is not None and accepted is not None and option not in accepted:
        prefix = key[: len("CKPTIO_") + len(name) + 1]
        raise SettingsError(
            f"environment variable {key}: the {entry.name!r} backend has no option {option!r}"
            f"{_did_you_mean(key, [prefix + o.upper() for o in accepted])} (its variables are {prefix}"
            f"<OPTION> for OPTION in {', '.join(o.upper() for o in sorted(accepted))})"
        )
