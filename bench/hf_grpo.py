"""The peer of loom's GRPO step in bench/run_grpo.sh: a plain PyTorch loop doing what loom's step does,
on the same random-init Llama-3-8B shape with PEFT LoRA r=16 on every projection, bf16: 8 prompts of
50 tokens x 8 completions of exactly 256 tokens sampled with transformers' generate (static cache,
temperature 1, the adapter live), a reference pass with the adapter disabled (no gradients), and the
update (GRPO's per-token loss with a KL term, TRL's "dapo" normalisation, in micro-batches of 16
rows, then AdamW). Each part timed with the GPU synchronised; steps after the first are reported.

  python3 bench/hf_grpo.py --steps 4 --out FILE
"""
import argparse
import json
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--group", type=int, default=8)
parser.add_argument("--new", type=int, default=256)
parser.add_argument("--micro", type=int, default=16)
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, torch_dtype=torch.bfloat16)
with torch.device("cuda"):
    base = LlamaForCausalLM(config).to(torch.bfloat16)
model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
model.config.use_cache = True
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
prompts = torch.randint(3, 259, (args.prompts, 50), device="cuda").repeat_interleave(args.group, 0)
prompt_mask = torch.ones_like(prompts)


def sync():
    torch.cuda.synchronize()
    return time.perf_counter()


def token_logps(ids, mask, completion_from):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, completion_from - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(2, ids[:, completion_from:].unsqueeze(2)).squeeze(2)


rows = []
for step in range(args.steps):
    t0 = sync()
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=prompt_mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=args.new, min_new_tokens=args.new, cache_implementation="static", pad_token_id=0)
    t1 = sync()
    mask = torch.ones_like(out)
    start = prompts.size(1)
    rewards = torch.rand(args.prompts, args.group, device="cuda")
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    refs = []
    with torch.no_grad(), model.disable_adapter():
        for i in range(0, out.size(0), args.micro):
            refs.append(token_logps(out[i : i + args.micro], mask[i : i + args.micro], start))
    t2 = sync()
    model.train()
    tokens = out[:, start:].numel()
    for k, i in enumerate(range(0, out.size(0), args.micro)):
        logp = token_logps(out[i : i + args.micro], mask[i : i + args.micro], start)
        ratio = torch.exp(logp - logp.detach())
        a = adv[i : i + args.micro].unsqueeze(1)
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        gap = refs[k] - logp
        per_token = per_token + 0.04 * (torch.exp(gap) - gap - 1)
        (per_token.sum() / tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = sync()
    rows.append({"step": step + 1, "generation_s": t1 - t0, "reference_s": t2 - t1, "update_s": t3 - t2, "step_s": t3 - t0})
    print(rows[-1], flush=True)

timed = rows[1:] if len(rows) > 1 else rows
mean = {k: sum(r[k] for r in timed) / len(timed) for k in ("generation_s", "reference_s", "update_s", "step_s")}
result = {"steps": rows, "mean_after_first": mean, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
          "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
json.dump(result, open(args.out, "w"), indent=1)
print(json.dumps(mean))
