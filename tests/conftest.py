"""Root fixtures. Real components are started by the fixture modules listed here."""
import os

import torch

pytest_plugins = ["tests.kafka_broker", "tests.prometheus_server"]

# Triton's interpreter must be chosen before triton is first imported anywhere
# in the process; on a CUDA machine the kernels run compiled instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
