"""Running work at the same moment on real connections, for the race tests."""

from __future__ import annotations

import threading

from django.db import connection


def together(threads: int, work) -> list:
    """work(i) in `threads` threads released at once, each on its own connection; the
    results in the order they finished."""
    barrier = threading.Barrier(threads)
    results, lock = [], threading.Lock()

    def run(i):
        try:
            barrier.wait(10)
            result = work(i)
        finally:
            connection.close()
        with lock:
            results.append(result)

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(60)
    return results
