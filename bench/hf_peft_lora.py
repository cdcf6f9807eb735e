#!/usr/bin/env python3
"""Peer measurement for loom's H200 benchmark: LoRA training throughput of HF transformers + PEFT on a
random-init Llama-3-8B-shaped model, bf16 on cuda:0, SDPA attention, no gradient checkpointing.

    python3 bench/hf_peft_lora.py [--steps 20] [--warmup 5] [--batch 4] [--seq 1024] [--json OUT]

LoRA r=16, alpha=32, dropout 0 on q,k,v,o,gate,up,down; AdamW lr 1e-4 on the LoRA parameters; random
token batches (fixed seed) with labels = input_ids. Reports tokens/s = steps*batch*seq/elapsed over
the timed steps, and the peak torch.cuda.max_memory_allocated over the whole run, model included.
Nothing is downloaded: the model is built from its config with HF's random init.
"""
import os

# Everything is built locally; make any accidental hub lookup fail instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import dataclasses
import inspect
import json
import sys
import time

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def uses_rope_parameters(config_cls):
    # transformers 5 keeps rope_theta inside a `rope_parameters` dict; 4 takes `rope_theta` directly.
    if dataclasses.is_dataclass(config_cls):
        if "rope_parameters" in {f.name for f in dataclasses.fields(config_cls)}:
            return True
    return "rope_parameters" in inspect.signature(config_cls.__init__).parameters


def llama3_8b_config():
    kwargs = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    if uses_rope_parameters(LlamaConfig):
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    else:
        kwargs["rope_theta"] = 500000.0
    return LlamaConfig(**kwargs)


def build_model(config, device):
    # Default dtype bf16 plus a device context make every parameter born on the GPU in bf16, so the
    # 8B weights never exist in fp32 or in host memory (the rotary inv_freq stays fp32 by design).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    wrong = {(p.dtype, p.device.type) for p in model.parameters()} - {(torch.bfloat16, "cuda")}
    if wrong:
        sys.exit(f"hf_peft_lora: parameters not all bf16 on cuda: {wrong}")
    return model


def build_lora_model(config, device, lora_dtype, checkpointing=False):
    """build_model() with PEFT LoRA r=16, alpha=32, no dropout on every projection, in training
    mode; the adapters in fp32 (PEFT's default) or, with lora_dtype "bf16", in the base's dtype;
    with checkpointing, transformers' gradient checkpointing of every decoder layer (non-reentrant)."""
    model = build_model(config, device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                      bias="none", task_type="CAUSAL_LM")
    peft_kwargs = {}
    if "autocast_adapter_dtype" in inspect.signature(get_peft_model).parameters:
        peft_kwargs["autocast_adapter_dtype"] = lora_dtype == "fp32"
    model = get_peft_model(model, lora, **peft_kwargs)
    model.train()
    return model


def main():
    ap = argparse.ArgumentParser(description="HF transformers + PEFT LoRA throughput on a Llama-3-8B shape.")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--seed", type=int, default=0, help="seed for init and token batches (default 0)")
    ap.add_argument("--lora-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="LoRA weight dtype: fp32 is PEFT's default (autocast_adapter_dtype), bf16 keeps "
                         "them in the base model's dtype (default fp32)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute every decoder layer in backward (transformers' gradient checkpointing)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as a JSON object to OUT")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        ap.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 2")
    if not torch.cuda.is_available():
        sys.exit("hf_peft_lora: CUDA is not available")

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    # Peak is reported over the whole run, so the weights count.
    torch.cuda.reset_peak_memory_stats(device)

    config = llama3_8b_config()
    model = build_lora_model(config, device, args.lora_dtype, args.gradient_checkpointing)

    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_total = sum(p.numel() for p in model.parameters())
    lora_dtype = str(trainable[0].dtype).replace("torch.", "")
    opt = torch.optim.AdamW(trainable, lr=1e-4)

    # All batches drawn up front on the GPU so the timed loop does no host work.
    gen = torch.Generator(device=device).manual_seed(args.seed)
    batches = torch.randint(0, config.vocab_size, (args.warmup + args.steps, args.batch, args.seq),
                            generator=gen, device=device)

    def step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup):
        step(batches[i])
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    losses = [step(batches[args.warmup + i]) for i in range(args.steps)]
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start

    final_loss = losses[-1].item()
    tokens = args.steps * args.batch * args.seq
    result = {
        "framework": "hf-transformers+peft",
        "model": "llama-3-8b shape, random init",
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "dtype": "bfloat16",
        "lora_dtype": lora_dtype,
        "attn_implementation": "sdpa",
        "gradient_checkpointing": args.gradient_checkpointing,
        "lora_r": 16,
        "lora_alpha": 32,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "elapsed_s": elapsed,
        "step_ms": 1000.0 * elapsed / args.steps,
        "tokens_per_s": tokens / elapsed,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "params_total": n_total,
        "params_trainable": n_trainable,
        "final_loss": final_loss,
    }
    print(
        f"hf-peft lora: {result['tokens_per_s']:,.0f} tokens/s, {result['step_ms']:.1f} ms/step, "
        f"peak {result['peak_mem_gib']:.2f} GiB, loss {final_loss:.3f} "
        f"(batch {args.batch} x seq {args.seq}, {args.steps} steps after {args.warmup} warmup; "
        f"{result['gpu']}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if not torch.isfinite(torch.tensor(final_loss)):
        sys.exit("hf_peft_lora: loss is not finite")


if __name__ == "__main__":
    main()
