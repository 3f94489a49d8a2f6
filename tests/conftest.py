"""Root fixtures. Real components are started by the fixture modules listed here."""
import os

import pytest

import torch

pytest_plugins = ["tests.kafka_broker", "tests.prometheus_server"]

# Triton's interpreter must be chosen before triton is first imported anywhere
# in the process; on a CUDA machine the kernels run compiled instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _denormals_as_the_test_found_them():
    """A training run flushes denormals for the whole process (train.loop.configure_torch:
    saturated units made matrix products 4x slower). The next test in that process must
    not inherit it: hypothesis refuses to draw floats when subnormals read as zero, and
    which test comes next depends on how the suite is split across workers."""
    yield
    torch.set_flush_denormal(False)
