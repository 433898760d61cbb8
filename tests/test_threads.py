"""``ckptio.threads``: work too small for a thread runs inline; the shared pool survives a fork; pools still run
work while the interpreter exits."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from ckptio import threads


def test_inline_runs_at_once_and_hands_errors_through_the_future():
    ran = []
    with threads.executor(4, "t", nbytes=threads.PARALLEL_MIN - 1) as ex:
        assert isinstance(ex, threads.Inline)
        f = ex.submit(ran.append, 1)
        assert ran == [1] and f.done() and f.result() is None
        bad = ex.submit(int, "x")
        with pytest.raises(ValueError):
            bad.result()
    with threads.executor(1, "t", nbytes=threads.PARALLEL_MIN) as ex:
        assert not isinstance(ex, threads.Inline) and ex.submit(int, "7").result() == 7


def _child(q):
    q.put(threads.shared_pool().submit(os.getpid).result(timeout=20))


def test_shared_pool_starts_anew_in_a_forked_child():
    # the parent's pool has an idle thread: a child that reused it would queue work no thread ever runs
    assert threads.shared_pool().submit(os.getpid).result() == os.getpid()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung on the shared pool")
    assert p.exitcode == 0 and q.get(timeout=5) == p.pid


def test_more_concurrent_remote_loads_than_shared_threads(s3_uri):
    import concurrent.futures as cf

    import torch

    import ckptio

    state = {"w": torch.randn(1000), "b": torch.arange(5)}
    uri = f"{s3_uri}/many.fpk"
    ckptio.dump(state, uri)
    n = threads.SHARED_WORKERS + 8  # read-ahead requests queue for the shared threads, and all finish
    with cf.ThreadPoolExecutor(n) as ex:
        outs = [f.result(timeout=120) for f in [ex.submit(ckptio.load, uri) for _ in range(n)]]
    assert all(torch.equal(o["w"], state["w"]) and torch.equal(o["b"], state["b"]) for o in outs)


def test_pool_shut_down_by_its_owner_refuses_work_as_any_pool():
    from ckptio.threads import Pool

    pool = Pool(2, thread_name_prefix="t")
    assert pool.submit(lambda: 3).result() == 3
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 4)


def test_pools_still_run_tasks_while_the_interpreter_exits(tmp_path):
    """In an atexit handler (where a plain ThreadPoolExecutor refuses work): tasks run on at most
    max_workers threads of the pool's own, two tasks that wait on each other in a pool of two both
    run, errors come through the future, shutdown(wait=True) joins the threads, cancel_futures
    cancels what is queued; an inline_at_exit pool runs each task in the caller."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, threading, time
            from ckptio.threads import Pool

            def at_exit():
                both = threading.Barrier(2, timeout=20)
                with Pool(2, thread_name_prefix="t") as pool:
                    a, b = pool.submit(both.wait), pool.submit(both.wait)
                    bad = pool.submit(lambda: 1 / 0)
                print(sorted([a.result(), b.result()]), type(bad.exception()).__name__)

                peak, lock, running = [0], threading.Lock(), [0]
                def task():
                    with lock:
                        running[0] += 1
                        peak[0] = max(peak[0], running[0])
                    time.sleep(0.01)
                    with lock:
                        running[0] -= 1
                with Pool(3, thread_name_prefix="t") as pool:
                    futures = [pool.submit(task) for _ in range(40)]
                    names = {t.name for t in threading.enumerate() if t.name.startswith("t-exiting")}
                print(all(f.done() for f in futures), peak[0] <= 3, len(names) <= 3)

                pool = Pool(1, thread_name_prefix="t")
                slow = pool.submit(time.sleep, 0.5)
                queued = [pool.submit(time.sleep, 0) for _ in range(5)]
                pool.shutdown(wait=True, cancel_futures=True)
                print(slow.done(), all(q.cancelled() for q in queued))

                inline = Pool(1, thread_name_prefix="t", inline_at_exit=True)
                f = inline.submit(threading.current_thread)
                print(f.done() and f.result() is threading.current_thread())

            atexit.register(at_exit)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["[0, 1] ZeroDivisionError", "True True True", "True True", "True"], (
        out.stdout + out.stderr
    )


def test_all_of_ends_once_every_future_has():
    """threads.all_of: the sum of the results; a failure is reported only once the others are done too
    (a read ahead must not be still writing into a buffer its caller gives up); none: 0 at once."""
    import concurrent.futures as cf
    import threading

    assert threads.all_of([]).result(timeout=1) == 0
    futs: list[cf.Future[int]] = [cf.Future() for _ in range(3)]
    out = threads.all_of(futs)
    futs[0].set_result(2)
    futs[1].set_exception(OSError("no"))
    assert not out.done() and not out.cancel()  # running: a caller's close() waits for it
    release = threading.Timer(0.05, futs[2].set_result, (5,))
    release.start()
    with pytest.raises(OSError, match="no"):
        out.result(timeout=5)
    assert futs[2].done()
    ok = [cf.Future() for _ in range(2)]
    total = threads.all_of(ok)
    for i, f in enumerate(ok):
        f.set_result(i + 3)
    assert total.result(timeout=1) == 7
    gone = [cf.Future(), cf.Future()]
    either = threads.all_of(gone)
    gone[0].cancel()
    gone[1].set_result(1)
    with pytest.raises(cf.CancelledError):
        either.result(timeout=1)
