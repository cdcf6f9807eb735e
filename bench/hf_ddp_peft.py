#!/usr/bin/env python3
r"""Peer for loom's data-parallel benchmark: HF transformers + PEFT LoRA on the random-init
Llama-3-8B shape of bench/hf_peft_lora.py (bf16, SDPA, no gradient checkpointing), one full replica
per GPU, gradients averaged by torch DistributedDataParallel over NCCL.

    torchrun --standalone --nproc-per-node 2 bench/hf_ddp_peft.py --json OUT.json \
        [--steps 30] [--warmup 10] [--batch 4] [--seq 1024]

(--nproc-per-node 1 gives the one-GPU reference through the same code.) LoRA r=16, alpha=32,
dropout 0 on q,k,v,o,gate,up,down, adapters bf16 by default; AdamW lr 1e-4 (fused) on the LoRA
parameters. Each rank draws its own random token batches of --batch x --seq (per GPU) with
labels = input_ids. tokens_per_s = world_size*steps*batch*seq / elapsed over the timed steps (the
slowest rank's time); peak memory is torch.cuda.max_memory_allocated of each rank over the whole
run, model included. NCCL settings come from the environment untouched. Nothing is downloaded.
"""
import os

# Everything is built locally; make any accidental hub lookup fail instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import inspect
import json
import math
import sys
import time

import peft
import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_peft_lora import build_lora_model, llama3_config  # noqa: E402  (same model as the one-GPU bench)


def main():
    ap = argparse.ArgumentParser(description="HF transformers + PEFT LoRA under DDP on a Llama-3-8B shape (run with torchrun).")
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps (default 30)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step per GPU (default 4)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--seed", type=int, default=0, help="seed for init; rank r's batches use seed+r (default 0)")
    ap.add_argument("--lora-dtype", choices=("fp32", "bf16"), default="bf16",
                    help="LoRA weight dtype: bf16 keeps them in the base model's dtype (the faster setting), "
                         "fp32 is PEFT's default autocast_adapter_dtype (default bf16)")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                    help="fused AdamW where torch has it (default on)")
    ap.add_argument("--static-graph", action=argparse.BooleanOptionalAction, default=True,
                    help="DDP static_graph: the graph is the same every step, so DDP may skip per-step "
                         "graph bookkeeping (default on)")
    ap.add_argument("--json", metavar="OUT", help="rank 0 also writes the results as a JSON object to OUT")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        ap.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 2")
    if "LOCAL_RANK" not in os.environ:
        sys.exit("hf_ddp_peft: launch with torchrun (LOCAL_RANK is not set)")
    if not torch.cuda.is_available():
        sys.exit("hf_ddp_peft: CUDA is not available")

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    # The device must be current before NCCL starts, or every rank's communicator lands on cuda:0.
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", device_id=device)
    try:
        run(args, device)
    finally:
        dist.destroy_process_group()


def run(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    # Same seed on every rank: identical base weights and LoRA init (DDP broadcasts rank 0's anyway).
    torch.manual_seed(args.seed)
    # Peak is reported over the whole run, so the weights count.
    torch.cuda.reset_peak_memory_stats(device)

    config = llama3_config()
    model = build_lora_model(config, device, args.lora_dtype)

    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_total = sum(p.numel() for p in model.parameters())
    lora_dtype = str(trainable[0].dtype).replace("torch.", "")

    # gradient_as_bucket_view: grads live in the allreduce buckets, no second copy. broadcast_buffers
    # off: the only buffer is the constant rotary inv_freq, so re-broadcasting it each forward is waste.
    ddp = DDP(model, device_ids=[device.index], gradient_as_bucket_view=True, broadcast_buffers=False,
              static_graph=args.static_graph)

    fused = args.fused and "fused" in inspect.signature(torch.optim.AdamW).parameters
    opt = torch.optim.AdamW(trainable, lr=1e-4, **({"fused": True} if fused else {}))

    # All batches drawn up front on the GPU so the timed loop does no host work; each rank its own data.
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    batches = torch.randint(0, config.vocab_size, (args.warmup + args.steps, args.batch, args.seq),
                            generator=gen, device=device)

    def step(ids):
        loss = ddp(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()  # DDP averages the LoRA gradients across ranks, overlapped with backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step(batches[i]) for i in range(args.warmup)]
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[device.index])  # start the clock together on every rank
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    losses += [step(batches[args.warmup + i]) for i in range(args.steps)]
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start

    mine = {
        "rank": rank,
        "gpu": torch.cuda.get_device_name(device),
        "elapsed_s": elapsed,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "first_loss": losses[0].item(),
        "final_loss": losses[-1].item(),
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank != 0:
        return

    # The step is a collective, so ranks finish together; the slowest clock is the honest one.
    elapsed = max(r["elapsed_s"] for r in ranks)
    tokens = world * args.steps * args.batch * args.seq
    first_loss = sum(r["first_loss"] for r in ranks) / world
    final_loss = sum(r["final_loss"] for r in ranks) / world
    result = {
        "framework": "hf-transformers+peft+ddp",
        "model": "llama-3-8b shape, random init",
        "gpu": ranks[0]["gpu"],
        "world_size": world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),  # recorded, never set here
        "dtype": "bfloat16",
        "lora_dtype": lora_dtype,
        "attn_implementation": "sdpa",
        "gradient_checkpointing": False,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "adamw_fused": fused,
        "ddp_static_graph": args.static_graph,
        "batch": args.batch,
        "global_batch": world * args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "elapsed_s": elapsed,
        "step_ms": 1000.0 * elapsed / args.steps,
        "tokens_per_s": tokens / elapsed,
        "tokens_per_s_per_gpu": tokens / elapsed / world,
        "peak_mem_gib": [r["peak_mem_gib"] for r in ranks],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in ranks],
        "params_total": n_total,
        "params_trainable": n_trainable,
        "first_loss": first_loss,
        "final_loss": final_loss,
        "first_loss_per_rank": [r["first_loss"] for r in ranks],
        "final_loss_per_rank": [r["final_loss"] for r in ranks],
    }
    print(
        f"hf-peft ddp x{world}: {result['tokens_per_s']:,.0f} tokens/s "
        f"({result['tokens_per_s_per_gpu']:,.0f}/GPU), {result['step_ms']:.1f} ms/step, peak "
        + ", ".join(f"{g:.2f}" for g in result["peak_mem_gib"])
        + f" GiB, loss {first_loss:.3f} -> {final_loss:.3f} "
        f"(batch {args.batch}/GPU x seq {args.seq}, {args.steps} steps after {args.warmup} warmup; "
        f"{result['gpu']}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}, lora {lora_dtype}, fused AdamW {fused}, static_graph {args.static_graph})",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if not math.isfinite(final_loss):
        # Raise rather than sys.exit so main's finally still tears the process group down.
        raise RuntimeError("hf_ddp_peft: loss is not finite")


if __name__ == "__main__":
    main()
