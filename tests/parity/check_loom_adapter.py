#!/usr/bin/env python3
"""Checks a LoRA adapter written by loom against HF transformers + PEFT: the adapter must load into
PEFT with every key matching a parameter of the same shape (and nothing missing), and the HF logits
with it must match the logits loom computed.

    python3 tests/parity/check_loom_adapter.py --base MODEL_DIR --adapter ADAPTER_DIR \
        --inputs INPUTS_JSON --logits LOOM_LOGITS_SAFETENSORS [--tol 1e-4] [--ignore-padding]

INPUTS_JSON holds input_ids, attention_mask and (optionally) position_ids, as make_fixtures.py writes
it; LOOM_LOGITS_SAFETENSORS holds "logits" [batch, seq, vocab]. Runs fp32 on CPU with eager attention.
Exit 0 when the keys are strict and max |HF - loom| <= tol, 1 otherwise.
"""
import os

# Everything is local; make any accidental hub lookup fail instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ADAPTER_NAME = "default"  # the name PeftModel.from_pretrained gives the adapter it loads
TF_MAJOR = int(transformers.__version__.split(".")[0])


def load_inputs(path):
    data = json.loads(Path(path).read_text())
    input_ids = torch.tensor(data["input_ids"], dtype=torch.long)
    attention_mask = torch.tensor(data.get("attention_mask", [[1] * input_ids.shape[1]] * input_ids.shape[0]),
                                  dtype=torch.long)
    if "position_ids" in data:
        position_ids = torch.tensor(data["position_ids"], dtype=torch.long)
    else:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def saved_key(param_name):
    """The key PEFT writes for a parameter: the adapter-name segment dropped
    ("...q_proj.lora_A.default.weight" -> "...q_proj.lora_A.weight"), and for base-layer tensors
    (bias="all"/"lora_only") the ".base_layer" wrapper dropped as well."""
    parts = [p for p in param_name.split(".") if p not in (ADAPTER_NAME, "base_layer")]
    return ".".join(parts)


def check_keys(model, file_tensors, allow_bias):
    """Every tensor in the file must map to an adapter parameter of the PEFT model (or, when the
    adapter trains biases, a bias) with the same shape and, once loaded, the same value; every
    adapter parameter must come from the file."""
    params = dict(model.named_parameters())
    by_key = {}
    for name, p in params.items():
        is_adapter = ADAPTER_NAME in name.split(".")
        if is_adapter or (allow_bias and name.endswith(".bias")):
            by_key.setdefault(saved_key(name), (name, p))
    adapter_keys = {saved_key(n) for n in params if ADAPTER_NAME in n.split(".")}

    unexpected = sorted(k for k in file_tensors if k not in by_key)
    missing = sorted(adapter_keys - set(file_tensors))
    bad_shape, bad_value = [], []
    for k, t in sorted(file_tensors.items()):
        if k not in by_key:
            continue
        name, p = by_key[k]
        if tuple(t.shape) != tuple(p.shape):
            bad_shape.append(f"{k}: file {tuple(t.shape)} vs model {name} {tuple(p.shape)}")
        elif not torch.equal(p.detach().cpu(), t.to(p.dtype)):
            bad_value.append(f"{k} -> {name}")

    ok = True
    for title, items in (
        ("unexpected adapter keys (no matching adapter parameter)", unexpected),
        ("missing adapter keys (adapter parameter not in the file)", missing),
        ("shape mismatches", bad_shape),
        ("loaded values differ from the file", bad_value),
    ):
        if items:
            ok = False
            print(f"FAIL {title}: {len(items)}")
            for item in items:
                print(f"  {item}")
    print(f"adapter tensors: {len(file_tensors)} in file, {len(adapter_keys)} adapter parameters in the model")
    return ok


def main():
    ap = argparse.ArgumentParser(description="Compare a loom-written LoRA adapter with HF transformers + PEFT.")
    ap.add_argument("--base", required=True, type=Path, help="HF model folder (config.json + safetensors)")
    ap.add_argument("--adapter", required=True, type=Path, help="PEFT adapter folder loom wrote")
    ap.add_argument("--inputs", required=True, type=Path, help="inputs.json")
    ap.add_argument("--logits", required=True, type=Path, help="safetensors with loom's \"logits\"")
    ap.add_argument("--tol", type=float, default=1e-4, help="max absolute logit error allowed (default 1e-4)")
    ap.add_argument("--ignore-padding", action="store_true",
                    help="judge only positions where attention_mask is 1 (padded query rows are "
                         "fully masked and their values depend on each implementation's mask fill)")
    args = ap.parse_args()

    weights = args.adapter / "adapter_model.safetensors"
    for f in (args.adapter / "adapter_config.json", weights, args.inputs, args.logits):
        if not f.is_file():
            print(f"FAIL missing file: {f}")
            return 1
    adapter_cfg = json.loads((args.adapter / "adapter_config.json").read_text())
    print(f"adapter: r={adapter_cfg.get('r')} alpha={adapter_cfg.get('lora_alpha')} "
          f"rslora={adapter_cfg.get('use_rslora', False)} targets={adapter_cfg.get('target_modules')}")

    dtype_kw = "dtype" if TF_MAJOR >= 5 else "torch_dtype"
    base = AutoModelForCausalLM.from_pretrained(
        str(args.base), attn_implementation="eager", local_files_only=True, **{dtype_kw: torch.float32}
    )
    # PEFT only warns about key problems; record its warnings so they fail the check.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = PeftModel.from_pretrained(base, str(args.adapter), adapter_name=ADAPTER_NAME)
        except Exception as e:  # e.g. size mismatches, which torch reports key by key
            print(f"FAIL PEFT could not load the adapter: {type(e).__name__}: {e}")
            return 1
    model.eval()
    ok = True
    for w in caught:
        msg = str(w.message)
        if "key" in msg.lower() and ("missing" in msg.lower() or "unexpected" in msg.lower()):
            print(f"FAIL PEFT warned: {msg}")
            ok = False

    allow_bias = adapter_cfg.get("bias", "none") in ("all", "lora_only")
    ok = check_keys(model, load_file(str(weights)), allow_bias) and ok

    inputs = load_inputs(args.inputs)
    with torch.no_grad():
        hf = model(**inputs, use_cache=False).logits.to(torch.float32)
    loom = load_file(str(args.logits))
    if "logits" not in loom:
        print(f"FAIL {args.logits} has no \"logits\" tensor (has {sorted(loom)})")
        return 1
    loom_logits = loom["logits"].to(torch.float32)
    if tuple(loom_logits.shape) != tuple(hf.shape):
        print(f"FAIL logits shape: loom {tuple(loom_logits.shape)} vs HF {tuple(hf.shape)}")
        return 1
    if not torch.isfinite(loom_logits).all():
        print("FAIL loom logits contain non-finite values")
        return 1

    diff = (hf - loom_logits).abs()
    real = inputs["attention_mask"].bool()
    err_all = diff.max().item()
    err_real = diff[real].max().item()
    err = err_real if args.ignore_padding else err_all
    print(f"max abs error: {err_all:.3e} all positions, {err_real:.3e} non-padding "
          f"(max |HF logit| {hf.abs().max().item():.4f}); tol {args.tol:.1e}")
    if not err <= args.tol:  # also catches NaN
        print("FAIL logits differ beyond tolerance")
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
