"""Root fixtures. Real components are started by the fixture modules listed here."""
import os

import pytest

import torch

pytest_plugins = ["tests.kafka_broker", "tests.prometheus_server"]

# Triton's interpreter must be chosen before triton is first imported anywhere
# in the process; on a CUDA machine the kernels run compiled instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A training run without --threads takes fewer threads when the machine is loaded
# (stream_ctr/threads.py). The suite itself loads the machine, and tests that compare
# two runs bit for bit need both to take the same thread count: pin the load the runs
# see (inherited by the CLI subprocesses); test_threads.py sets its own.
os.environ.setdefault("STREAM_CTR_LOAD_AVG", "0")


@pytest.fixture(autouse=True)
def _denormals_as_the_test_found_them():
    """A training run flushes denormals for the whole process (train.loop.configure_torch:
    saturated units made matrix products 4x slower). The next test in that process must
    not inherit it: hypothesis refuses to draw floats when subnormals read as zero, and
    which test comes next depends on how the suite is split across workers."""
    yield
    torch.set_flush_denormal(False)
