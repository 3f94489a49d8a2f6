"""`shutdown` frees the process group: its gloo threads end before the interpreter does.

A group that outlives `destroy_process_group` keeps gloo's worker threads until
interpreter exit, where one that drops a finished collective's work (Python
tensors: it needs the GIL) aborts the rank ("terminate called without an active
exception"), now and then, under load. torch.distributed.nn pinned the group that
way when torch imported it lazily after `init_process_group`. A fresh interpreter
is needed: the test process (and the rank harness's fork server) imported it long ago.
"""
import os
import subprocess
import sys

from tests.stream_ctr.distributed.harness import free_port

RANK = r"""
import os, sys
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from stream_ctr.distributed.context import init_distributed, shutdown

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
assert "torch.distributed.nn" not in sys.modules     # a fresh interpreter, as a torchrun rank
init_distributed(torch.device("cpu"), timeout_s=30)
pg = dist.group.WORLD
out = [None]
dist.all_gather_object(out, {"rank": 0})                 # a finished work, as at the end of a run
import torch.distributed.nn                              # what torch imports lazily (inductor, _shard)
shutdown()
print("refs", sys.getrefcount(pg) - 2)                   # none left but this test's `pg`
del pg
print("threads", threads() - before)                     # gloo's workers and its loop are joined
"""


def test_shutdown_joins_the_groups_threads_even_after_torch_distributed_nn_is_imported():
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split() for line in out.stdout.splitlines() if line.startswith(("refs", "threads")))
    assert lines == {"refs": "0", "threads": "0"}, out.stdout
