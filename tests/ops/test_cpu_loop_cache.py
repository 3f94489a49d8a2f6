"""Every compiled CPU loop of the training step loads from numba's cache in a later
process: a loop that compiles again in each process (a closure over another jit
function does that) costs ~0.5 s at the start of every run and every bench."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, torch
from stream_ctr.ops import cowclip_adam, cpu_rows, deepfm_input, unique
from stream_ctr.store import probe_cpu
keys = torch.tensor([5, 3, 5, 9])
unique.unique_keys(keys)
w = torch.zeros(16, 4)
cowclip_adam.cowclip_adam_cpu(w, w.clone(), w.clone(), torch.arange(3), torch.ones(3, 4),
                              torch.ones(3, dtype=torch.int64), step=1, lr=1e-3, l2=0.0,
                              clip_r=1.0, clip_zeta=1e-5, clip_dims=4, beta1=0.9, beta2=0.999, eps=1e-7)
cpu_rows.index_add_rows(torch.ones(4, 2), torch.tensor([0, 1, 0, 1]), 2)
emb = torch.randn(3, 2, 4, requires_grad=True)
fm, x0 = deepfm_input._DeepFMInput.apply(emb, torch.zeros(3, 1))
(fm.sum() + x0.float().sum()).backward()
table = torch.full((8,), -1, dtype=torch.int64)
probe_cpu.place(table, torch.zeros(8, dtype=torch.int64), keys[:2], keys[:2], torch.tensor([1, 2]))
probe_cpu.find_positions(table, keys, keys % 8)
from stream_ctr.store import key_filter, policies
from stream_ctr.store.slot_index import SlotIndex
index = SlotIndex(8)
index.insert(keys[:2], keys[:2])
index.lookup(keys)
index.remove(keys[:1])
policies.select_victims(torch.tensor([3, 1, 2, 1]), keys, 2)
bloom = key_filter.KeyFilter(16)
bloom.add(keys.numpy())
bloom.maybe(keys.numpy())
loops = {"unique": unique._kernels(), "cowclip_adam": (cowclip_adam._cpu_kernel(),),
         "cpu_rows": (cpu_rows._kernel(),), "deepfm_input": deepfm_input._kernels(),
         "probe_cpu": (probe_cpu._kernel(), probe_cpu._place_kernel()),
         "slot_index": probe_cpu._pair_kernels(), "victims": (policies._victims_kernel(),),
         "key_filter": (key_filter._kernel(),)}
print(json.dumps({name: sum(sum(f.stats.cache_misses.values()) for f in fs) for name, fs in loops.items()}))
"""


def test_every_loop_loads_from_the_cache_in_a_second_process(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def misses() -> dict:
        out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = misses()
    assert all(n > 0 for n in first.values()), first       # compiled into the empty cache
    second = misses()
    assert second == {name: 0 for name in first}, second
