"""The check the kernels' concurrency tests share: a session shared by threads gives each
call the bits the same call gets run alone."""
from __future__ import annotations

import threading

import numpy as np


def threads_give_sequential_bits(run, feeds: list, repeats: int = 1) -> None:
    """run(feed) for each feed in turn, then each in a thread of its own (`repeats` times
    there, all threads at once): the same arrays, bit for bit."""
    sequential = [run(f) for f in feeds]
    results = [None] * len(feeds)

    def work(i):
        for _ in range(repeats):
            results[i] = run(feeds[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, sequential):
        np.testing.assert_array_equal(got, want)
