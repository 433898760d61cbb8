"""What a retried request tells the user while it waits (:meth:`RetryPolicy.run` logs it as a warning, which
the ``ckptio`` command shows without ``-v``).

The first failed attempt of a request that will be retried names the operation, the URI, the endpoint, the
error, the attempt count and the longest the attempts left can take (bounded by ``deadline``; each bounded by
``timeout``, else only by the deadline), and how long they take if the endpoint keeps not answering (each then
ends after ``stall_timeout``, or ``timeout`` if shorter), with the options and variables that change this.
Later retries are one line each.
"""

from __future__ import annotations

from typing import Any


def retrying(
    policy: Any, what: str, uri: str, said: str, attempt: int, elapsed: float, delay: float, where: Any = None
) -> str:
    """The warning for attempt ``attempt`` of ``what`` of ``uri`` having failed with ``said`` after ``elapsed``
    seconds (of the request), to be retried after ``delay`` seconds; ``where``: the backend (its ``endpoint``,
    where its requests go, and ``name``) or None."""
    if attempt > 1:
        return (
            f"retrying {what} of {uri} after {said} (attempt {attempt} of {policy.max_attempts}, waiting {delay:.2f}s)"
        )
    left = policy.max_attempts - attempt
    time_left = max(0.0, policy.deadline - elapsed)
    waits = sum(min(policy.max_delay, policy.base_delay * 2**k) for k in range(left))  # the longest backoffs
    quiet = policy.stall_timeout if policy.timeout is None else min(policy.stall_timeout, policy.timeout)
    at_most = time_left if policy.timeout is None else min(time_left, left * policy.timeout + waits)
    name = getattr(where, "name", "")
    endpoint = getattr(where, "endpoint", None) or (f"the default {name} endpoint" if name else "")
    name = name or "<BACKEND>"
    var = f"CKPTIO_{name.upper()}_<OPTION>"
    return (
        f"{what} of {uri}{f' at {endpoint}' if endpoint else ''}: attempt 1 of {policy.max_attempts} failed after "
        f"{elapsed:.1f}s ({said}); retrying: the {left} attempt(s) left take at most {at_most:.0f}s more, about "
        f"{min(at_most, left * quiet + waits):.0f}s if the endpoint keeps not answering ({quiet:g}s each). "
        f"Options max_attempts={policy.max_attempts}, timeout={policy.timeout}, stall_timeout="
        f"{policy.stall_timeout:g}, deadline={policy.deadline:g} ([backends.{name}] in the settings file or {var}; "
        "see docs/failures.md)"
    )
