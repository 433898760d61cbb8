"""A child process that dumps a checkpoint and is interrupted while it writes (issue 51, item 9).

``python interrupt_workers.py SPEC_JSON``; the spec's keys:

* ``uri``: where to dump (its extension picks the format: ``.pt`` or ``.fpk``); ``s3``: the S3 options
  (moto's endpoint), or null; ``mib``: the size of the state (tensors of 1 MiB).
* ``how``: ``bytes``: once ``at`` bytes were written, the progress callback (called from the writer's
  ``write``) sends SIGINT to this process (or, with ``raise``, raises that exception: ``ENOSPC``, an
  OSError; ``integrity``, a ckptio error; ``memory``, MemoryError); ``timer``: a thread sends SIGINT
  ``at`` seconds after the dump starts (it lands anywhere: torch's Python code, the pickler, a writer).
* ``catch``: false: the exception leaves the program (its traceback on stderr, exit status 1);
  true: the child prints ``RAISED <type name> <message>``, or ``FINISHED`` when the dump won the race
  (then ``RAISED KeyboardInterrupt`` from the timer's late SIGINT), and exits 0.

Nothing is checked here: the parent lists what the dump left behind.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time

import torch

import ckptio
from ckptio.errors import IntegrityError

RAISES = {
    "ENOSPC": lambda: OSError(errno.ENOSPC, "No space left on device (injected)"),
    "integrity": lambda: IntegrityError("injected: a ckptio error from the writer"),
    "memory": lambda: MemoryError("injected"),
}


def main(spec: dict) -> None:
    if spec.get("s3"):
        ckptio.configure(backends={"s3": spec["s3"]})
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(spec["mib"])}  # 1 MiB each
    signal.signal(signal.SIGINT, signal.default_int_handler)
    kw: dict = {}
    if spec["how"] == "bytes":
        fired: list[int] = []

        def progress(done: int, total: int) -> None:
            if done >= spec["at"] and not fired:
                fired.append(done)
                if spec.get("raise"):
                    raise RAISES[spec["raise"]]()
                os.kill(os.getpid(), signal.SIGINT)

        kw["progress"] = progress
    else:
        timer = threading.Timer(spec["at"], os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
    if not spec.get("catch"):
        ckptio.dump(state, spec["uri"], **kw)
        print("FINISHED", flush=True)
        return
    try:
        ckptio.dump(state, spec["uri"], **kw)
        print("FINISHED", flush=True)
        time.sleep(spec["at"] + 1 if spec["how"] == "timer" else 0)  # the timer's SIGINT lands here
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        print(f"RAISED {type(e).__name__} {str(e)[:200]!r}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
