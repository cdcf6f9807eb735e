"""Peer measurement for bench/run_moe.sh: LoRA training throughput of transformers 5 + PEFT on a
random-init mixture of experts (bench/qwen3_30b_a3b/config.json: Qwen3-30B-A3B's shape, 12 layers),
bf16 on cuda:0, SDPA attention, experts through `experts_implementation` ("grouped_mm" or "eager"),
no gradient checkpointing.

    python3 bench/hf_moe_lora.py [--experts-impl grouped_mm] [--expert-lora] [--steps 20] [--warmup 5]
                                 [--batch 4] [--seq 1024] [--json OUT] [--shape qwen3_30b_a3b]
                                 [--targets q_proj,k_proj,v_proj,o_proj]

--shape names the folder under bench/ whose config.json it builds (deepseek_v2_lite: DeepSeek-V2-Lite's
shape in DeepSeek-V3's architecture, LoRA on q_proj, kv_a_proj_with_mqa, kv_b_proj and o_proj).

LoRA r=16, alpha=32, no dropout, adapters in bf16, on q, k, v, o (with --expert-lora also every
expert's gate_up_proj and down_proj through PEFT's target_parameters); AdamW lr 1e-4 on the LoRA
parameters; random tokens (fixed seed), labels = input_ids. tokens/s = timed steps x batch x seq /
elapsed; peak = torch.cuda.max_memory_allocated over the whole run, model included.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import sys
import time

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

BENCH = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "eager"])
    ap.add_argument("--expert-lora", action="store_true", help="LoRA on every expert too (PEFT target_parameters)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--shape", default="qwen3_30b_a3b")
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    args = ap.parse_args()
    device = torch.device("cuda:0")
    config = AutoConfig.from_pretrained(os.path.join(BENCH, args.shape), local_files_only=True)
    config.use_cache = False
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation=args.experts_impl)
    finally:
        torch.set_default_dtype(previous)
    if getattr(model.config, "_experts_implementation", args.experts_impl) != args.experts_impl:
        sys.exit(f"hf_moe_lora: experts run {model.config._experts_implementation!r}, not {args.experts_impl!r}")
    extra = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if args.expert_lora else {}
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=args.targets.split(","), bias="none",
                      task_type="CAUSAL_LM", **extra)
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen, device=device)
    start = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "tokens_per_s": args.steps * args.batch * args.seq / elapsed,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "trainable": sum(p.numel() for p in trainable),
        "experts": args.experts_impl,
        "shape": args.shape,
        "expert_lora": args.expert_lora,
        "loss": loss.item(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
