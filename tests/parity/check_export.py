#!/usr/bin/env python3
"""Loads what `loom export` wrote with transformers itself and compares its logits with
transformers' logits of the base with the PEFT adapter applied (the parity Llama's fixture).
Run where transformers is installed (the GPU machine; CI has no transformers), after exporting:

  build/bin/loom export P.toml --adapter tests/fixtures/parity/llama/adapter --output DIR/merged --max-shard-size 40KB
  (P.toml: [model] path = tests/fixtures/parity/llama, [adapter] plugin = "lora", [placement] single on cpu)
  python3 tests/parity/check_export.py DIR tests/fixtures/parity/llama

With DIR/m-{f32,f16,q8_0}.gguf beside it (loom export --format gguf) and the gguf package installed,
transformers' GGUF loader reads those too (it undoes llama.cpp's rotary order and dequantizes Q8_0).
"""
import json
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

out, fixture = sys.argv[1], sys.argv[2]
inputs = json.load(open(f"{fixture}/inputs.json"))
ids = torch.tensor(inputs["input_ids"])
mask = torch.tensor(inputs.get("attention_mask", [[1] * len(r) for r in inputs["input_ids"]]))
reference = load_file(f"{fixture}/logits_adapter.safetensors")["logits"].float()


def gap(model):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    return (logits[real] - reference[real]).abs().max().item()


print("transformers", transformers.__version__)
print("hf folder: max |logits - transformers(base + PEFT)| =", gap(AutoModelForCausalLM.from_pretrained(f"{out}/merged", dtype=torch.float32)))
for kind in ("f32", "f16", "q8_0"):
    try:
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=f"m-{kind}.gguf", dtype=torch.float32)
        print(f"gguf {kind}: max |logits - transformers(base + PEFT)| =", gap(model))
    except (ImportError, OSError, ValueError) as e:
        print(f"gguf {kind}: not read ({type(e).__name__}: {str(e)[:200]})")
