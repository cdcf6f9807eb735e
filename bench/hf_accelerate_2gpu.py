#!/usr/bin/env python3
"""Peer for loom's two-GPU device-map benchmark: HF transformers + PEFT LoRA on the shape of
bench/llama8b_2gpu.toml (random-init Llama-3-8B, fp16, LoRA r=16 alpha=32 on q,k,v,o, batch 2 x 512),
either on one GPU or spread over two by accelerate's device_map, as `device_map="auto"` with
`max_memory` would spread it.

    python3 bench/hf_accelerate_2gpu.py --placement single|device_map [--steps 40] [--warmup 10] [--json OUT]

device_map: the model is built with its parameters on the meta device, accelerate's get_balanced_memory + infer_auto_device_map
(no split inside a decoder layer, max_memory 15 GiB per GPU, as loom's run) choose the cut, and
each weight is made on its GPU, and dispatch_model installs the hooks that move activations
between them: what from_pretrained(device_map="auto") does, less reading a checkpoint. PEFT is attached afterwards, as users do,
with its defaults (adapter weights upcast to fp32). Tokens/s = steps*batch*seq/elapsed over the timed
steps; peak memory is torch.cuda.max_memory_allocated per GPU over the whole run. Random token batches;
nothing is downloaded.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import sys
import time

import accelerate
import peft
import torch
import transformers
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from accelerate.utils import get_balanced_memory, set_module_tensor_to_device
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_peft_lora import llama3_config  # noqa: E402  (same shape as the one-GPU bench)


def build(placement):
    config = llama3_config()
    if placement == "single":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        try:
            with torch.device("cuda:0"):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        return model, {"": 0}
    # Parameters on the meta device (buffers real), as from_pretrained does before loading.
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    model = model.to(torch.float16)
    max_memory = {0: "15GiB", 1: "15GiB"}
    no_split = model._no_split_modules
    balanced = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                   dtype=torch.float16)
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split,
                                       dtype=torch.float16)
    if any(d in ("cpu", "disk") for d in device_map.values()):
        sys.exit(f"hf_accelerate_2gpu: accelerate put part of the model off the GPUs: {device_map}")
    # "Load" each weight straight onto its GPU: N(0, 0.02) as HF's init, norms at one.
    for name, param in list(model.named_parameters()):
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        device = torch.device("cuda", device_map[owner])
        value = torch.empty(param.shape, dtype=torch.float16, device=device)
        value.fill_(1.0) if name.endswith("norm.weight") else value.normal_(0.0, 0.02)
        set_module_tensor_to_device(model, name, device, value=value)
    model = dispatch_model(model, device_map=device_map)
    return model, device_map


def main():
    ap = argparse.ArgumentParser(description="HF + PEFT LoRA on one GPU or over two with accelerate's device_map.")
    ap.add_argument("--placement", choices=("single", "device_map"), required=True)
    ap.add_argument("--steps", type=int, default=40, help="timed optimizer steps (default 40)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    if torch.cuda.device_count() < (2 if args.placement == "device_map" else 1):
        sys.exit("hf_accelerate_2gpu: not enough CUDA devices")
    torch.manual_seed(0)
    devices = list(range(torch.cuda.device_count()))  # a fresh process: peaks count from zero

    model, device_map = build(args.placement)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-4)
    # fp16 weights with fp32 adapters: scale the loss as fp16 training must (what Trainer's fp16 does).
    scaler = torch.amp.GradScaler("cuda")

    first = "cuda:0"
    gen = torch.Generator(device=first).manual_seed(0)
    batches = torch.randint(0, 128256, (args.warmup + args.steps, args.batch, args.seq), generator=gen, device=first)

    def step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        for d in devices:
            torch.cuda.synchronize(d)

    for i in range(args.warmup):
        step(batches[i])
    sync()
    start = time.perf_counter()
    losses = [step(batches[args.warmup + i]) for i in range(args.steps)]
    sync()
    elapsed = time.perf_counter() - start
    peaks = {f"cuda:{d}": torch.cuda.max_memory_allocated(d) / 2**30 for d in devices}
    used = sorted({f"cuda:{v}" for v in device_map.values()})
    result = {
        "framework": "hf-transformers+peft+accelerate",
        "placement": args.placement,
        "devices": used,
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
        "accelerate": accelerate.__version__,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
        "tokens_per_s": args.steps * args.batch * args.seq / elapsed,
        "peak_gib": {d: peaks[d] for d in used},
        "final_loss": losses[-1].item(),
    }
    if args.placement == "device_map":
        per_device = {}
        for name, dev in device_map.items():
            per_device.setdefault(f"cuda:{dev}", []).append(name)
        result["device_map"] = {d: [names[0], names[-1], len(names)] for d, names in per_device.items()}
    print(f"hf {args.placement}: {result['tokens_per_s']:,.0f} tokens/s, peak "
          + ", ".join(f"{d} {g:.2f} GiB" for d, g in result["peak_gib"].items())
          + f", loss {result['final_loss']:.3f}"
          + (f", map {result['device_map']}" if "device_map" in result else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
