#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A training step's first compile: flex_attention (B2 H8 S4096 D128 bf16, causal block mask) through torch.compile.

    python3 bench/flex_step.py            # prints {"first_call_s": ..., "cache_dir": ...}

The compile-cache step's warm-up runs it once, alone, single-threaded (TORCHINDUCTOR_COMPILE_THREADS=1), so the
training run that follows finds the cache warm (bench/hardware_cache.sh, docs/hardware.md).
"""

import json
import os
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def causal(_batch, _head, q_index, kv_index):
    return q_index >= kv_index


def main():
    q, k, v = (torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = create_block_mask(causal, None, None, 4096, 4096, device="cuda")
    compiled = torch.compile(flex_attention)
    started = time.perf_counter()
    compiled(q, k, v, block_mask=mask)
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    print(json.dumps({"first_call_s": round(first, 2), "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))


if __name__ == "__main__":
    main()
