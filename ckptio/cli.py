"""The ``ckptio`` command: ls, cp, rm, info, verify, du, cache, config, bench.

Every command takes ``--json`` (one JSON document on stdout), ``--quiet`` (no progress, no
summary lines) and ``-v`` (a traceback on errors). Errors go to stderr as one line and a hint.

Exit status:

====  ==========================================================================
0     success
1     failure: corrupt or truncated data (verify, info), an incomplete checkpoint,
      a transfer error, anything unexpected
2     usage: bad arguments, invalid settings, unknown scheme or format
3     not found: the object, directory or bucket does not exist
4     access denied or missing/rejected credentials
5     a needed optional package is not installed (the message says which)
130   interrupted (Ctrl-C)
====  ==========================================================================

This module only builds the parser, runs commands and formats their output. The work is done by
library calls users can make too: :func:`ckptio.transfer.copy` (``cp``), :func:`ckptio.info` and
:func:`ckptio.verify` (``info``, ``verify``; each format inspects and checks its own files),
:func:`ckptio.checkpointer.usage` (``du``).
``ckptio.cli.copy``/``info``/``verify`` are re-exports of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from . import config as _config
from . import uri as _uri
from .cli_parser import Parser
from .context import default_context, resolve
from .errors import (
    CkptioError,
    FormatError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidURIError,
    MissingDependencyError,
    SettingsError,
    TransferError,
    UnknownFormatError,
    UnknownSchemeError,
    UnsafeKeyError,
    redact,
)
from .formats.base import jsonable
from .inspect import info, verify
from .progress import Bar, human_bytes
from .transfer import CopyResult, copy, path_kind

__all__ = ["CopyResult", "copy", "info", "main", "verify"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
EXIT_DENIED, EXIT_MISSING_DEP, EXIT_INTERRUPTED = 4, 5, 130


class UsageError(Exception):
    """Bad command-line use (exit status 2)."""


# ---------------------------------------------------------------------------------------------
# output


class Out:
    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(getattr(args, "json", False))
        self.quiet = bool(getattr(args, "quiet", False))
        self.verbose = bool(getattr(args, "verbose", False))

    def emit(self, data: Any, text: Callable[[], str] | str | None = None) -> None:
        if self.json:
            print(redact(json.dumps(jsonable(data), indent=2)))
        elif text is not None:
            s = text() if callable(text) else text
            if s:
                print(redact(s))

    def note(self, msg: str) -> None:
        if not self.quiet and not self.json:
            print(redact(msg), file=sys.stderr)

    def bar(self, total: int, desc: str) -> Bar:
        return Bar(total, redact(desc), enabled=False if self.quiet else None)


def _tensor_table(tensors: list[dict[str, Any]], limit: int | None = None) -> str:
    if not tensors:
        return "  (no tensors)"
    shown = tensors if limit is None else tensors[:limit]
    w = min(60, max(3, *(len(str(t.get("key", ""))) for t in shown)))
    lines = [f"  {'key':<{w}}  {'dtype':<10} {'shape':<20} {'size':>10}"]
    for t in shown:
        shape = "x".join(str(s) for s in t.get("shape") or []) or "()"
        lines.append(
            f"  {str(t.get('key', '')):<{w}}  {str(t.get('dtype', '')):<10} {shape:<20} "
            f"{human_bytes(int(t.get('nbytes', 0) or 0)):>10}"
        )
    if limit is not None and len(tensors) > limit:
        lines.append(f"  ... {len(tensors) - limit} more (use --all or --json)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# commands


def _as_given(given: str, resolved: str, child: str) -> str:
    """``child`` (a resolved URI under ``resolved``) spelled the way the user wrote ``given`` (alias, mapping)."""
    if given == resolved:
        return child
    if child.rstrip("/") == resolved.rstrip("/"):
        return given
    return _uri.join_path(given, child[len(resolved.rstrip("/")) :].lstrip("/"))


def cmd_ls(args: argparse.Namespace, out: Out) -> int:
    if args.steps or args.local_tier:
        return _ls_steps(args, out)
    backend, uri = resolve(args.uri)
    if path_kind(backend, uri) == "file":
        entries = [backend.stat(uri)]
    else:
        entries = sorted(backend.list(uri, recursive=args.recursive), key=lambda i: i.uri)
    rows: list[dict[str, Any]] = [
        {
            "uri": _as_given(args.uri, uri, i.uri),
            "size": i.size,
            "mtime": i.mtime,
            "version": i.version,
            "is_dir": i.is_dir,
        }
        for i in entries
    ]

    def text() -> str:
        if not args.long:
            return "\n".join(r["uri"] + ("/" if r["is_dir"] else "") for r in rows)
        lines = []
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["mtime"])) if r["mtime"] else "-"
            lines.append(f"{'DIR' if r['is_dir'] else human_bytes(r['size']):>10}  {when:<19}  {r['uri']}")
        total = sum(r["size"] for r in rows)
        lines.append(f"{len(rows)} entries, {human_bytes(total)}")
        return "\n".join(lines)

    out.emit(rows, text)
    return EXIT_OK


def _ls_steps(args: argparse.Namespace, out: Out) -> int:
    from .checkpointer.tiered import status

    rows = [{"step": s, "state": st} for s, st in status(args.uri, args.local_tier).items()]
    out.emit(rows, lambda: "\n".join(f"{r['step']:>12}  {r['state']}" for r in rows))
    return EXIT_OK


def cmd_cp(args: argparse.Namespace, out: Out) -> int:
    with out.bar(0, "cp") as bar:
        res = copy(
            args.src, args.dst, recursive=args.recursive, jobs=args.jobs, skip_existing=args.resume, progress=bar
        )
    rate = res.bytes_copied / res.seconds / 1e9 if res.seconds > 0 else 0.0
    data = {
        "copied": len(res.copied),
        "skipped": len(res.skipped),
        "bytes": res.bytes_copied,
        "seconds": round(res.seconds, 4),
        "gb_per_s": round(rate, 4),
        "files": res.copied,
        "skipped_files": res.skipped,
    }
    out.emit(
        data,
        None
        if out.quiet
        else (
            f"copied {len(res.copied)} file(s), {human_bytes(res.bytes_copied)} in {res.seconds:.2f}s "
            f"({rate:.3f} GB/s); skipped {len(res.skipped)} already up to date"
        ),
    )
    return EXIT_OK


def _storage_root(uri: str) -> str | None:
    """What a resolved ``uri`` is the whole of (``"bucket"``, ``"filesystem"``), or None when it is below that."""
    scheme, rest = _uri.split(uri)
    if scheme in ("", "file"):
        return "filesystem" if os.path.realpath(os.path.expanduser(rest) or ".") == os.path.realpath(os.sep) else None
    return "bucket" if "/" not in rest.strip("/") else None


def _confirmed(question: str) -> bool:
    """Ask on a terminal; anything but yes (or no terminal) is no."""
    if not sys.stdin.isatty():
        return False
    print(f"{redact(question)} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def cmd_rm(args: argparse.Namespace, out: Out) -> int:
    backend, uri = resolve(args.uri)
    if path_kind(backend, uri) == "dir":
        if not args.recursive:
            raise UsageError(f"{args.uri} is a directory; pass -r to remove it and everything under it")
        whole = _storage_root(uri)
        if whole and not args.force:
            named = args.uri if args.uri == uri else f"{args.uri} ({uri})"
            if not _confirmed(f"ckptio rm: {named} is a whole {whole}; remove everything in it?"):
                raise UsageError(
                    f"refusing to remove everything in {named}: it is a whole {whole}; pass --force to remove it all"
                )
        victims = [i.uri for i in backend.list(uri, recursive=True) if not i.is_dir]
        backend.rmtree(uri)
        if _uri.scheme_of(uri) in ("", "file"):  # local directories stay behind empty; object stores have none
            import shutil

            shutil.rmtree(uri.removeprefix("file://"), ignore_errors=True)
    else:
        backend.delete(uri)
        victims = [uri]
    out.emit({"removed": victims}, None if out.quiet else f"removed {len(victims)} object(s)")
    return EXIT_OK


def _steps_table(data: dict[str, Any]) -> str:
    """A Checkpointer root, one line per step (``ckptio info ROOT``)."""
    rows = data["steps"]
    latest = data.get("latest")
    lines = [
        f"{data['uri']}: Checkpointer root, {len(rows)} step(s)"
        + (f", latest {latest}" if latest is not None else "")
        + (f"; local tier {data['local_tier']}" if data.get("local_tier") else "")
    ]
    lines.append(f"  {'step':>12}  {'format':<6} {'size':>10}  {'state':<28} metrics")
    for r in rows:
        state = r["state"]
        if state == "committed":
            state = ("durable" if r["durable"] else "local only") + (
                f" ({r['where']})" if r["where"] not in ("root", "local") else ""
            )
            if r.get("incremental"):
                state += ", incremental"
        metrics = " ".join(f"{k}={v}" for k, v in (r.get("metrics") or {}).items())
        if r.get("kept"):
            metrics = f"[kept: {', '.join(r['kept'])}] {metrics}"
        lines.append(
            f"  {r['step']:>12}  {r.get('format') or '-':<6} {human_bytes(r['size']):>10}  {state:<28} {metrics}"[
                :200
            ].rstrip()
        )
        if r.get("problem"):
            lines.append(f"  {'':>12}  {r['problem']}"[:200])
    if data.get("kept_problem"):
        lines.append(f"kept steps unknown: {data['kept_problem']}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace, out: Out) -> int:
    data = info(args.uri, step=args.step, local_tier=args.local_tier)

    def text() -> str:
        if data.get("kind") == "checkpointer":
            return _steps_table(data)
        lines = [f"{data['uri']}: {data.get('format') or 'unknown format'}, {human_bytes(data.get('size') or 0)}"]
        tensors = data.get("tensors") or []
        if tensors or data.get("format") in ("torch", "dcp", "fastpickle", "safetensors"):
            lines.append(f"{len(tensors)} tensors, {human_bytes(data.get('tensor_bytes') or 0)}")
            lines.append(_tensor_table(tensors, None if args.all else 50))
        values = data.get("values") or {}
        if values:
            lines.append("other values:")
            for k, v in list(values.items())[: None if args.all else 30]:
                lines.append(f"  {k} = {v if isinstance(v, str) else json.dumps(v)}"[:160])
        if data.get("data_files"):
            lines.append("data files: " + ", ".join(f"{k} ({human_bytes(v)})" for k, v in data["data_files"].items()))
        extra = {
            k: v
            for k, v in data.items()
            if k not in ("uri", "format", "size", "tensors", "tensor_bytes", "values", "data_files")
        }
        for k, v in extra.items():
            lines.append(f"{k}: {v if isinstance(v, str) else json.dumps(v)}"[:200])
        return "\n".join(lines)

    out.emit(data, text)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, out: Out) -> int:
    data = verify(args.uri)
    out.emit(data, None if out.quiet else f"{args.uri}: ok ({data['format']}; {data.get('what', 'checked')})")
    return EXIT_OK


def cmd_cache(args: argparse.Namespace, out: Out) -> int:
    from . import cache

    table = default_context().settings.cache  # the settings file's [cache] table
    cache_dir = args.cache_dir or os.path.expanduser(table.get("dir") or cache.default_cache_dir())
    exists = os.path.isdir(cache_dir)
    before = cache.usage(cache_dir)  # reads only: works on a read-only or missing directory
    if args.action == "stats":
        data = {"cache_dir": cache_dir, "exists": exists, **before}
        partial = f" ({human_bytes(before['partial_bytes'])} of it partial fills)" if before["partial_bytes"] else ""
        out.emit(
            data,
            f"cache {cache_dir}: {data['entries']} entries, {human_bytes(before['bytes'])}{partial}"
            + ("" if exists else " (does not exist yet)"),
        )
        return EXIT_OK
    if exists:
        cache.CacheStore(cache_dir).clear()
    after = cache.usage(cache_dir)["bytes"]
    data = {"cache_dir": cache_dir, "freed_bytes": before["bytes"] - after, "bytes_left": after}
    out.emit(
        data,
        None
        if out.quiet
        else f"cache {cache_dir}: freed {human_bytes(before['bytes'] - after)}"
        + (f", {human_bytes(after)} left in use by running readers" if after else ""),
    )
    return EXIT_OK


def cmd_config(args: argparse.Namespace, out: Out) -> int:
    s = default_context().settings.redacted()
    would = _config.default_file(os.environ)
    data = {**s, "settings_file": would}

    def text() -> str:
        lines = [
            f"settings file: {would or '(none found: defaults and environment only)'}",
            f"sources (lowest first): {', '.join(s['sources']) or '(defaults)'}",
        ]
        for name, opts in s["backends"].items():
            lines.append(f"[backends.{name}]")
            lines.extend(f"{k} = {json.dumps(jsonable(v))}" for k, v in opts.items())
        for name, a in s["aliases"].items():
            lines.append(
                f"[aliases.{name}]  target = {json.dumps(a['target'])}"
                + (f"  options = {json.dumps(jsonable(a['options']))}" if a["options"] else "")
            )
        if s["path_mapping"]:
            lines.append("[path_mapping]")
            lines.extend(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in s["path_mapping"].items())
        for table in ("cache", "checkpointer"):
            if s.get(table):
                lines.append(f"[{table}]")
                lines.extend(f"{k} = {json.dumps(jsonable(v))}" for k, v in s[table].items())
        return "\n".join(lines)

    out.emit(data, text)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace, out: Out) -> int:
    argv = list(args.bench_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if out.json and "--json" not in argv:
        argv.append("--json")
    if out.quiet and "--quiet" not in argv:
        argv.append("--quiet")
    from .bench import throughput  # imported on use only: `import ckptio` stays cheap

    return int(throughput.main(argv) or 0)


# ---------------------------------------------------------------------------------------------
# parser and error handling


def cmd_du(args: argparse.Namespace, out: Out) -> int:
    from .checkpointer import usage

    data = usage(args.uri)

    def text() -> str:
        lines = [f"{'step':>12}  {'logical':>10}  {'own':>10}"]
        for r in data["steps"]:
            inc = "" if r["incremental"] else "  (not incremental)"
            lines.append(
                f"{r['step']:>12}  {human_bytes(r['logical_bytes']):>10}  {human_bytes(r['own_bytes']):>10}{inc}"
            )
        lines.append(
            f"physical {human_bytes(data['physical_bytes'])} (content {human_bytes(data['content_bytes'])}, "
            f"unreferenced {human_bytes(data['unreferenced_content_bytes'])})"
        )
        return "\n".join(lines)

    out.emit(data, text)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    common.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bar or summary lines"
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="show a traceback on errors"
    )
    p = Parser(
        prog="ckptio",
        parents=[common],
        description="Checkpoint I/O on any storage.",
        epilog="exit status: 0 ok, 1 failure or corruption, 2 usage or settings, 3 not found, "
        "4 access denied, 5 missing optional package, 130 interrupted",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    a = sub.add_parser("ls", parents=[common], help="list a directory/prefix or show one object")
    a.add_argument("uri")
    a.add_argument("-r", "--recursive", action="store_true")
    a.add_argument("-l", "--long", action="store_true", help="sizes and modification times")
    a.add_argument("--steps", action="store_true", help="a Checkpointer root: its committed steps")
    a.add_argument(
        "--local-tier", metavar="DIR", help="with --steps: also this node's local tier (local/remote per step)"
    )
    a.set_defaults(func=cmd_ls)

    a = sub.add_parser("cp", parents=[common], help="copy between any backends (resumable, parallel)")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument(
        "-r",
        "--recursive",
        action="store_true",
        help="copy a directory/prefix; symlinks in a local source tree (to files or directories) are "
        "not followed: each is skipped with a warning",
    )
    a.add_argument("-j", "--jobs", type=int, default=4, help="files copied in parallel (default 4)")
    a.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted copy: skip destination files with the same size and an equal "
        "version or a newer mtime (a same-size, newer destination is assumed complete)",
    )
    a.set_defaults(func=cmd_cp)

    a = sub.add_parser("rm", parents=[common], help="remove an object (-r: a directory/prefix)")
    a.add_argument("uri")
    a.add_argument("-r", "--recursive", action="store_true")
    a.add_argument(
        "-f",
        "--force",
        action="store_true",
        help="with -r on a whole bucket (s3://B, gs://B, memory://B) or /: do not ask, remove it all",
    )
    a.set_defaults(func=cmd_rm)

    a = sub.add_parser(
        "info",
        parents=[common],
        help="keys, dtypes, shapes, sizes of .fpk, .pt, DCP, .safetensors, a Checkpointer step; "
        "a Checkpointer root: its steps",
    )
    a.add_argument("uri")
    a.add_argument("--all", action="store_true", help="do not truncate long tables")
    a.add_argument("--step", type=int, help="a Checkpointer root: show this step's keys, dtypes, shapes, sizes")
    a.add_argument("--local-tier", metavar="DIR", help="a Checkpointer root: also this node's local tier")
    a.set_defaults(func=cmd_info)

    a = sub.add_parser("verify", parents=[common], help="check stored checksums (exit 1 on corruption)")
    a.add_argument("uri")
    a.set_defaults(func=cmd_verify)

    a = sub.add_parser(
        "du", parents=[common], help="a Checkpointer root: per step logical and own bytes, physical total"
    )
    a.add_argument("uri")
    a.set_defaults(func=cmd_du)

    a = sub.add_parser("cache", parents=[common], help="node-local cache: stats | clear")
    a.add_argument("action", choices=["stats", "clear"])
    a.add_argument("--cache-dir", help="cache directory (default: from settings)")
    a.set_defaults(func=cmd_cache)

    a = sub.add_parser("config", parents=[common], help="effective settings (secrets redacted) and their files")
    a.set_defaults(func=cmd_config)

    a = sub.add_parser(
        "bench", help="throughput benchmark (see `ckptio bench --help`)", add_help=False, prefix_chars="+"
    )  # everything after `bench` goes to the benchmark
    a.add_argument("bench_args", nargs=argparse.REMAINDER)
    a.set_defaults(func=cmd_bench)
    return p


_HINTS: list[tuple[type, int, str]] = [
    (KeyboardInterrupt, EXIT_INTERRUPTED, "interrupted; `ckptio cp` can be rerun to resume"),
    (UsageError, EXIT_USAGE, "see `ckptio COMMAND --help`"),
    (IncompleteCheckpointError, EXIT_FAILURE, "the save did not finish; use an earlier checkpoint"),
    (IntegrityError, EXIT_FAILURE, "the data is corrupt or truncated; restore it from another copy"),
    (UnknownFormatError, EXIT_USAGE, "pass a file with a known extension (.fpk, .pt, .safetensors) or a DCP directory"),
    (FormatError, EXIT_FAILURE, "check that the URI points at a checkpoint in a supported format"),
    (UnsafeKeyError, EXIT_FAILURE, "the listing holds a crafted or corrupt key; nothing was copied"),
    (SettingsError, EXIT_USAGE, "fix the settings named above; `ckptio config` shows which file is used"),
    (UnknownSchemeError, EXIT_USAGE, "define the scheme as an alias in ckptio.toml or install its fsspec package"),
    (InvalidURIError, EXIT_USAGE, "URIs look like s3://bucket/key, gs://bucket/key, /local/path"),
    (MissingDependencyError, EXIT_MISSING_DEP, "install what the message names, e.g. pip install 'ckptio[all]'"),
    (FileNotFoundError, EXIT_NOT_FOUND, "check the URI; `ckptio ls PARENT` shows what exists"),
    (PermissionError, EXIT_DENIED, "check credentials and permissions; `ckptio config` shows the settings in use"),
    (IsADirectoryError, EXIT_USAGE, "pass -r for directories"),
    (NotADirectoryError, EXIT_USAGE, "the path is a file, not a directory"),
    (TransferError, EXIT_FAILURE, "check the endpoint (`ckptio config`); retries and timeouts: docs/failures.md"),
]


def _remapped(args: argparse.Namespace) -> list[str]:
    """For each URI argument that settings rewrite (path mapping, alias): what to and by which file."""
    try:
        s = default_context().settings
        out = []
        for given in (getattr(args, name, None) for name in ("uri", "src", "dst")):
            if isinstance(given, str):
                to, _ = s.resolve_alias(s.map_path(given))
                if to != given:
                    out.append(redact(f"{given} was remapped to {to} by {', '.join(s.sources) or 'configure()'}"))
        return out
    except CkptioError:  # the settings themselves are what failed: the error above says so
        return []


def _classify(e: BaseException) -> tuple[int, str]:
    for cls, code, hint in _HINTS:
        if isinstance(e, cls):
            return code, hint
    return EXIT_FAILURE, "rerun with -v for the traceback"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Out(args)
    try:
        code = args.func(args, out)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every error becomes one line and an exit status
        code, hint = _classify(e)
        msg = redact(" ".join(str(e).split())) or type(e).__name__
        if out.verbose:
            print(redact(traceback.format_exc()), end="", file=sys.stderr)
        print(f"ckptio {args.command}: error: {msg}", file=sys.stderr)
        print(f"  hint: {hint}", file=sys.stderr)
        for line in _remapped(args):
            print(f"  hint: {line}", file=sys.stderr)
        if out.json:
            print(json.dumps({"error": msg, "type": type(e).__name__, "exit_code": code}))
    finally:
        sys.stdout.flush()
    return code


def _entry() -> None:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
