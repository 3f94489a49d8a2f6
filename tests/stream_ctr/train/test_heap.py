"""train.heap_keep_bytes: glibc keeps a step's freed memory instead of faulting it in again."""
import subprocess
import sys

import pytest

from stream_ctr.config import ConfigError, load_config, validate

# Allocate, touch and free a 40 MB buffer 20 times, as a step does its activations (at
# batch 65,536 they are ~105 MB); print the minor page faults it took. Blocks over 32 MiB
# are always mapped afresh by glibc's default; smaller ones only after its trims. Run in a child: mallopt settings are for the whole process.
_CHILD = """
import resource, sys
import numpy as np
from stream_ctr.train.heap import keep_heap
print(keep_heap(int(sys.argv[1])))
for _ in range(3):
    np.ones(5 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    np.ones(5 << 20)                                       # 40 MB, written through
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep_bytes: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(keep_bytes)], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_kept_heap_serves_repeated_large_blocks_without_new_page_faults():
    took, kept = _faults(1 << 30)
    _, default = _faults(0)
    assert took
    # glibc's default maps each 40 MB block afresh: 20 faults a block even if the kernel
    # backs it with 2 MiB pages (10,240 with 4 KiB ones).
    assert default >= 20 * 20
    assert kept * 10 < default


def test_heap_keep_bytes_takes_a_byte_size_and_refuses_one_under_64mib():
    """Setting any threshold switches off glibc's own (which rises to 32 MiB), so a small
    one would map more blocks afresh than the default: refused, as is a negative one."""
    assert validate(load_config(None, ["train.heap_keep_bytes=512MiB"])).train.heap_keep_bytes == 512 << 20
    assert validate(load_config(None, ["train.heap_keep_bytes=0"])).train.heap_keep_bytes == 0
    for bad in ("-1", "1MiB"):
        with pytest.raises(ConfigError, match="heap_keep_bytes must be 0 .* or at least 64MiB"):
            validate(load_config(None, [f"train.heap_keep_bytes={bad}"]))
