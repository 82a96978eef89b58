"""One rank of a 2-rank ZeRO-3 teacher (launched by torchrun from test_multirank.py).

The ranks hold different numbers of rows and response widths, so they need different numbers of teacher
micro-batches and LM-head chunks; each builds every cache mode from the partitioned teacher and from a
replicated copy, and writes the largest difference and the cache bytes to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from opsd_rollout.deepspeed_engine import build_inference_engine
from opsd_rollout.models import load_model
from opsd_rollout.opsd import TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache
from opsd_rollout.opsd.teachers import resident_bytes
from deepspeed.runtime.rollout.base import RolloutBatch as Batch

teacher, _ = load_model("qwen2-tiny")
replicated = copy.deepcopy(teacher)
engine = build_inference_engine(teacher, 3)
rank = dist.get_rank()
rows, prompt, response = (5, 6, 3) if rank == 0 else (1, 4, 11)  # different rows and windows on each rank
generator = torch.Generator().manual_seed(rank)
ids = torch.randint(3, 259, (rows, prompt + response), generator=generator)
mask = torch.ones_like(ids)
mask[0, prompt + response - 1:] = 0  # a row that ended early
batch = Batch(input_ids=ids, attention_mask=mask, response_start_idx=torch.full((rows,), prompt))
report = {"rank": rank}
for mode in ("full", "topk", "sampled"):
    config = TeacherCacheConfig(mode=mode, top_k=7, micro_batch_size=2, chunk_size=4)
    partitioned = build_teacher_cache(engine, batch, config, buffers=TeacherCacheBuffers())
    whole = build_teacher_cache(replicated, batch, config, buffers=TeacherCacheBuffers())
    report[mode] = {"max_difference": float((partitioned.values.float() - whole.values.float()).abs().max()),
                    "indices_equal": partitioned.indices is None or bool(torch.equal(partitioned.indices, whole.indices)),
                    "bytes": partitioned.nbytes, "shape": list(partitioned.values.shape)}
report["parameter_bytes"] = resident_bytes(engine)  # what a step reports as teacher_parameter_bytes
report["replicated_bytes"] = resident_bytes(replicated)
assert report["replicated_bytes"] == sum(p.numel() * p.element_size() for p in replicated.parameters())
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as handle:
    json.dump(report, handle)
