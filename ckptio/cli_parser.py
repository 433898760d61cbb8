"""The ``ckptio`` command's argument parser: argparse's, with a did-you-mean for a misspelt option.

An option no command takes (``ckptio ls --recursve``) is refused by the command it was given to, showing
that command's usage and the closest of its options (``did you mean --recursive?``).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that knows its option strings (its own and its parents') to suggest one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.option_names: list[str] = []
        super().__init__(*args, **kwargs)
        for parent in kwargs.get("parents", ()):
            self.option_names += getattr(parent, "option_names", [])

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.option_names += action.option_strings
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        for given in extras:
            close = difflib.get_close_matches(given.partition("=")[0], self.option_names, n=1, cutoff=0.6)
            if given.startswith("-") and close:
                self.error(f"unrecognized arguments: {' '.join(extras)}; did you mean {close[0]}?")
        return ns, extras
