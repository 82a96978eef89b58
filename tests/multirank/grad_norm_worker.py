"""One rank of a 2-rank SFT step (launched by torchrun from test_multirank.py): each rank its own references, the
same student; the gradient norm ``sft_step(..., grad_norm=True)`` reports at ZeRO-0 (taken before the step, by us)
and at ZeRO-2 (DeepSpeed's, over partitioned gradients), written to OUT_DIR/rank{r}.json."""

from __future__ import annotations

import copy
import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from opsd_rollout.deepspeed_engine import deepspeed_config, init_distributed
from opsd_rollout.models import load_model
from opsd_rollout.train import Example, sft_step
from opsd_rollout.train.data import Encoder

init_distributed()
rank = dist.get_rank()
model, tokenizer = load_model("llama-tiny")
encoder = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=8)
pairs = ([Example("Hello", " world!"), Example("A longer prompt", " x")] if rank == 0
         else [Example("Why", " because."), Example("Then", " now then"), Example("So", " it goes")])
batch = encoder.with_references(pairs, torch.device("cpu"))  # different rows and tokens on each rank
report = {"rank": rank}
for stage in (0, 2):
    student = copy.deepcopy(model).train()
    config = {**deepspeed_config(stage, lr=1e-3, micro_batch_size=len(pairs)), "gradient_clipping": 1e-4}
    engine, *_ = deepspeed.initialize(model=student, model_parameters=list(student.parameters()), config=config)
    report[f"zero{stage}"] = sft_step(engine, batch, grad_norm=True).grad_norm
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as handle:
    json.dump(report, handle)
