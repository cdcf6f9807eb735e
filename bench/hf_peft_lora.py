#!/usr/bin/env python3
"""Peer measurement for loom's H200 benchmark: LoRA training throughput of HF transformers + PEFT on a
random-init Llama-3-8B-shaped (or Llama-3.2-1B-shaped) model, bf16 on cuda:0, SDPA attention, no
gradient checkpointing.

    python3 bench/hf_peft_lora.py [--shape 8b|1b|gemma3-4b] [--steps 20] [--warmup 5] [--batch 4] [--seq 1024]
                                  [--samples LENGTHS.jsonl [--padding-free]] [--json OUT]

LoRA r=16, alpha=32, dropout 0 on q,k,v,o,gate,up,down; AdamW lr 1e-4 on the LoRA parameters; random
token batches (fixed seed) with labels = input_ids. Reports tokens/s = steps*batch*seq/elapsed over
the timed steps, and the peak torch.cuda.max_memory_allocated over the whole run, model included.
With --samples (variable-length data, bench/make_instruct_lengths.py: one {"prompt": P,
"completion": C} token count a line), each step takes --batch samples in file order, padded to the
batch's longest (HF's default collation), loss on completion tokens only; tokens/s counts real
(non-pad) tokens. --padding-free lays each step's samples end to end in one row with positions
restarting per sample (what transformers' DataCollatorWithFlattening gives); before timing, the
script checks that a sample's logits there equal its padded ones (attention kept inside each
sample) and says so in the JSON ("padding_free_exact").
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
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def uses_rope_parameters(config_cls):
    # transformers 5 keeps rope_theta inside a `rope_parameters` dict; 4 takes `rope_theta` directly.
    if dataclasses.is_dataclass(config_cls):
        if "rope_parameters" in {f.name for f in dataclasses.fields(config_cls)}:
            return True
    return "rope_parameters" in inspect.signature(config_cls.__init__).parameters


SHAPES = {
    # Llama-3-8B and Llama-3.2-1B (the 1B ties its head to the embedding; its rope scaling is left
    # out, as loom's benchmark pipeline leaves it out).
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True),
    "gemma3-4b": None,  # bench/gemma3_4b/config.json
}


GEMMA3_4B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemma3_4b")  # its text config, as loom's bench reads it


def llama3_config(shape="8b"):
    if shape == "gemma3-4b":
        config = AutoConfig.from_pretrained(GEMMA3_4B, local_files_only=True)
        config.use_cache = False
        return config
    kwargs = dict(
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
        use_cache=False,
        **SHAPES[shape],
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
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
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


def load_lengths(path, count):
    """`count` samples' (prompt, completion) token counts from `path`, in file order, cycled."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append((int(r["prompt"]), int(r["completion"])))
    if not rows or any(p < 1 or c < 1 for p, c in rows):
        sys.exit(f"hf_peft_lora: {path}: need lines of positive prompt and completion counts")
    return [rows[i % len(rows)] for i in range(count)]


def sample_batch(lengths, vocab, gen, device, padding_free):
    """One step's samples as HF reads them: random tokens, labels only on completions. Padded to the
    longest (right, attention_mask 0, labels -100), or end to end in one row with positions
    restarting per sample (each sample's first label -100, so none crosses a boundary)."""
    seqs = [torch.randint(0, vocab, (p + c,), generator=gen, device=device) for p, c in lengths]
    labels = []
    for (p, c), ids in zip(lengths, seqs):
        lab = ids.clone()
        lab[:p] = -100
        labels.append(lab)
    real = sum(p + c for p, c in lengths)
    if padding_free:
        positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
        return {"input_ids": torch.cat(seqs)[None], "position_ids": positions[None], "labels": torch.cat(labels)[None], "real_tokens": real}
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    lab = torch.full_like(ids, -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
        lab[i, :len(s)] = l
    return {"input_ids": ids, "attention_mask": mask, "labels": lab, "real_tokens": real}


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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (default 8b)")
    ap.add_argument("--samples", metavar="JSONL",
                    help="variable-length samples, one {\"prompt\": P, \"completion\": C} token count a line; "
                         "--batch of them a step, --seq ignored")
    ap.add_argument("--padding-free", action="store_true",
                    help="with --samples: each step's samples end to end in one row, positions restarting")
    ap.add_argument("--json", metavar="OUT", help="also write the results as a JSON object to OUT")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        ap.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 2")
    if args.padding_free and not args.samples:
        ap.error("--padding-free needs --samples")
    if not torch.cuda.is_available():
        sys.exit("hf_peft_lora: CUDA is not available")

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    # Peak is reported over the whole run, so the weights count.
    torch.cuda.reset_peak_memory_stats(device)

    config = llama3_config(args.shape)
    model = build_lora_model(config, device, args.lora_dtype, args.gradient_checkpointing)

    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_total = sum(p.numel() for p in model.parameters())
    lora_dtype = str(trainable[0].dtype).replace("torch.", "")
    opt = torch.optim.AdamW(trainable, lr=1e-4)

    # All batches drawn up front on the GPU so the timed loop does no host work.
    gen = torch.Generator(device=device).manual_seed(args.seed)
    if args.samples:
        lengths = load_lengths(args.samples, (args.warmup + args.steps) * args.batch)
        batches = [sample_batch(lengths[i * args.batch:(i + 1) * args.batch], config.vocab_size, gen, device, args.padding_free)
                   for i in range(args.warmup + args.steps)]
    else:
        ids = torch.randint(0, config.vocab_size, (args.warmup + args.steps, args.batch, args.seq), generator=gen, device=device)
        batches = [{"input_ids": ids[i], "labels": ids[i], "real_tokens": args.batch * args.seq} for i in range(len(ids))]

    def step(batch):
        loss = model(**{k: v for k, v in batch.items() if k != "real_tokens"}, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    padding_free_exact = None
    if args.padding_free:
        # The second sample's logits, laid end to end after the first and padded in a batch: equal
        # (to bf16's noise) only if attention stayed inside each sample. A loss would not tell:
        # a random model's loss on random tokens hardly depends on what it attends to.
        with torch.no_grad():
            pair = lengths[:2]
            g1 = torch.Generator(device=device).manual_seed(1234)
            g2 = torch.Generator(device=device).manual_seed(1234)
            packed = sample_batch(pair, config.vocab_size, g1, device, True)
            padded = sample_batch(pair, config.vocab_size, g2, device, False)
            n0, n1 = sum(pair[0]), sum(pair[1])
            a = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0, n0:n0 + n1].float()
            b = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits[1, :n1].float()
            difference = ((a - b).norm() / b.norm()).item()
            padding_free_exact = difference < 5e-2
            print(f"padding-free: the second sample's logits differ from its padded ones by {difference:.3g} (relative): "
                  f"{'attention kept inside each sample' if padding_free_exact else 'samples see each other, not a valid peer'}")

    for i in range(args.warmup):
        step(batches[i])
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    losses = [step(batches[args.warmup + i]) for i in range(args.steps)]
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start

    final_loss = losses[-1].item()
    tokens = sum(b["real_tokens"] for b in batches[args.warmup:])
    result = {
        "framework": "hf-transformers+peft",
        "model": {"8b": "llama-3-8b shape", "1b": "llama-3.2-1b shape", "gemma3-4b": "gemma-3-4b text config"}[args.shape] + ", random init",
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
        "shape": args.shape,
        "batch": args.batch,
        "seq": None if args.samples else args.seq,
        "samples": args.samples,
        "padding_free": args.padding_free,
        "padding_free_exact": padding_free_exact,  # None unless --padding-free
        "real_tokens": tokens,
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
        f"({args.shape}, batch {args.batch} x {'samples of ' + args.samples if args.samples else 'seq ' + str(args.seq)}"
        f"{', padding-free' if args.padding_free else ''}, {args.steps} steps after {args.warmup} warmup; "
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
