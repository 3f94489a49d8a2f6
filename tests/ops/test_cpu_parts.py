"""ops.cpu_parts: parts of rows on threads, errors re-raised, a forked child's own pool."""
import multiprocessing as mp

import pytest
import torch

from stream_ctr.ops.cpu_parts import part_bounds, run_parts


def test_bounds_cover_the_rows_in_at_most_the_thread_count_of_parts():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert part_bounds(10, 100) == [0, 10]                 # too few rows: one part
        assert part_bounds(0, 100) == [0, 0]
        assert part_bounds(1000, 100) == [0, 500, 1000]
        torch.set_num_threads(1)
        assert part_bounds(1000, 100) == [0, 1000]
    finally:
        torch.set_num_threads(threads)


def test_every_part_runs_once_and_an_error_reaches_the_caller():
    seen = []
    run_parts(lambda k, lo, hi: seen.append((k, lo, hi)), [0, 3, 7, 9])
    assert sorted(seen) == [(0, 0, 3), (1, 3, 7), (2, 7, 9)]

    def fail_first(k, lo, hi):
        if k == 0:
            raise IndexError("part 0")
    with pytest.raises(IndexError, match="part 0"):
        run_parts(fail_first, [0, 1, 2])


def _in_child(queue):
    out = []
    run_parts(lambda k, lo, hi: out.append(k), [0, 1, 2, 3])
    queue.put(sorted(out))


def test_a_forked_child_gets_its_own_pool():
    run_parts(lambda k, lo, hi: None, [0, 1, 2])               # the parent's pool exists
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=60) == [0, 1, 2]
    child.join(timeout=60)
    assert child.exitcode == 0
