#!/usr/bin/env python3
"""The peer of bench/moe_block_bench.cpp: transformers' Qwen3MoeSparseMoeBlock, forward and backward
(every weight and the hidden states take gradients) in bf16 on the GPU, with its experts as
grouped_mm and as eager (a loop over experts).
  python3 bench/hf_moe_block.py TOKENS HIDDEN WIDTH EXPERTS TOP_K [ITERATIONS]"""
import sys
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

n, h, width, experts, k = (int(a) for a in sys.argv[1:6])
iterations = int(sys.argv[6]) if len(sys.argv) > 6 else 20
torch.manual_seed(0)
for implementation in ("grouped_mm", "eager"):
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=width, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=True)
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    hidden = torch.randn(1, n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn(1, n, h, device="cuda", dtype=torch.bfloat16)

    def step():
        (block(hidden) * probe).sum().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000 / iterations
    print(f"transformers {implementation}: {n} tokens, hidden {h}, {experts} experts of width {width}, top-{k}: {ms:.2f} ms forward+backward")
