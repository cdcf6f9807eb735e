#!/usr/bin/env python3
r"""Peer for loom's tensor-parallel benchmark: HF transformers' own tensor parallelism
(`from_pretrained(..., tp_plan="auto")`) with PEFT LoRA on the random-init Llama-3-8B shape of
bench/hf_peft_lora.py (bf16, SDPA), under torchrun.

    torchrun --standalone --nproc-per-node 2 bench/hf_tp_peft.py --json OUT.json \
        [--steps 15] [--warmup 5] [--batch 4] [--seq 1024] [--dir /tmp/hf-tp-llama8b]

tp_plan needs a checkpoint on disk: rank 0 saves the random-init model to --dir once (16 GB), the
others wait. Every rank feeds the same batch (tensor parallelism splits the layers, not the
data). LoRA r=16, alpha=32, dropout 0 on q,k,v,o,gate,up,down; AdamW lr 1e-4 on the LoRA
parameters. tokens_per_s = steps*batch*seq / elapsed over the timed steps; peak memory per rank is
torch.cuda.max_memory_allocated. If the stack refuses or fails (PEFT's layers are not TP-aware),
the JSON records the exception text instead: that is the measurement. Nothing is downloaded.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import sys
import time
import traceback

import torch
import torch.distributed as dist
import transformers
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_peft_lora import LORA_TARGETS, llama3_config  # noqa: E402  (the same shape as the one-GPU bench)


def main():
    ap = argparse.ArgumentParser(description="HF transformers tp_plan='auto' + PEFT LoRA on a Llama-3-8B shape (run with torchrun).")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/hf-tp-llama8b", help="where rank 0 saves the random-init checkpoint")
    ap.add_argument("--json", metavar="OUT", help="rank 0 writes the results here")
    args = ap.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit("hf_tp_peft: launch with torchrun (LOCAL_RANK is not set)")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"framework": f"hf-transformers {transformers.__version__} tp_plan=auto + peft", "world_size": world,
              "batch": args.batch, "seq": args.seq}
    try:
        if rank == 0 and not os.path.exists(os.path.join(args.dir, "config.json")):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(llama3_config(), dtype=torch.bfloat16)
            model.save_pretrained(args.dir)
            del model
        dist.barrier(device_ids=[local_rank])
        torch.cuda.reset_peak_memory_stats(device)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, tp_plan="auto")
        model.config.use_cache = False
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                                                 bias="none", task_type="CAUSAL_LM"))
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4)
        gen = torch.Generator(device=device).manual_seed(0)  # the same batches on every rank
        batches = torch.randint(0, 128256, (args.warmup + args.steps, args.batch, args.seq), generator=gen, device=device)

        def step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        losses = [step(batches[i]) for i in range(args.warmup)]
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[local_rank])
        start = time.perf_counter()
        losses += [step(batches[args.warmup + i]) for i in range(args.steps)]
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        mine = {"elapsed_s": elapsed, "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "first_loss": losses[0].item(), "final_loss": losses[-1].item()}
    except Exception as e:  # the stack's own error is the result
        mine = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    dist.destroy_process_group()
    if rank != 0:
        return
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        result["error"] = errors[0]
        result["traceback"] = next(r["traceback"] for r in ranks if "error" in r)
    else:
        elapsed = max(r["elapsed_s"] for r in ranks)
        result.update({"tokens_per_s": args.steps * args.batch * args.seq / elapsed, "peak_mem_gib": [r["peak_mem_gib"] for r in ranks],
                       "first_loss": ranks[0]["first_loss"], "final_loss": ranks[0]["final_loss"]})
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
