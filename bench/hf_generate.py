"""HF transformers' greedy generation on a random-init Llama shape (or Qwen3-30B-A3B's, --shape qwen3_30b_a3b), the peer of `loom generate` in
bench/run_generate.sh. Per batch size: ms per decode step as (time for LONG new tokens - time for
SHORT) / (LONG - SHORT), each timed after a warm run of the same length, so the prompt pass and the
set-up cancel; with the default (dynamic) cache and with cache_implementation="static" (on which
transformers compiles the decode step itself). Also the prompt pass (one forward) at given lengths,
and the peak memory. Writes one JSON object.

  python3 bench/hf_generate.py --shape 8b --prompts 1 4 16 64 --prompt-tokens 50 --out FILE
"""
import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
}
# Qwen3-30B-A3B whole (bench/qwen3_30b_a3b/config.json at its 48 layers), experts through grouped_mm.
MOE_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_30b_a3b")


def make_model(shape):
    if shape == "qwen3_30b_a3b":
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(MOE_CONFIG, local_files_only=True)
        config.num_hidden_layers = 48
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm")
        finally:
            torch.set_default_dtype(previous)
        return config, model.to(torch.bfloat16).eval()
    config = LlamaConfig(**SHAPES[shape], torch_dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return config, model


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES) + ["qwen3_30b_a3b"])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 4, 64, 16])
    ap.add_argument("--prompt-tokens", type=int, default=50)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=160)
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 2048])
    ap.add_argument("--caches", nargs="+", default=["dynamic", "static"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    config, model = make_model(a.shape)
    result = {"shape": a.shape, "torch": torch.__version__, "steps": {}, "prefill_s": {}}
    import transformers
    result["transformers"] = transformers.__version__
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for length in a.prefill:
            ids = torch.randint(0, config.vocab_size, (1, length), device="cuda", generator=gen)
            model(ids)  # warm
            result["prefill_s"][str(length)] = min(timed(lambda: model(ids)) for _ in range(3))
        for cache in a.caches:
            for prompts in a.prompts:
                ids = torch.randint(0, config.vocab_size, (prompts, a.prompt_tokens), device="cuda", generator=gen)
                mask = torch.ones_like(ids)

                def run(new):
                    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask, pad_token_id=0)
                    if cache == "static":
                        kwargs["cache_implementation"] = "static"
                    model.generate(ids, **kwargs)

                try:
                    times = {}
                    for new in (a.short, a.long):
                        run(new)  # warm: compilation, the cache, the allocator
                        times[new] = timed(lambda: run(new))
                    step = (times[a.long] - times[a.short]) / (a.long - a.short)
                    result["steps"][f"{cache}-x{prompts}"] = {"ms_per_step": 1e3 * step, "new_tokens_per_s": prompts / step}
                except Exception as e:  # one configuration failing leaves the others' numbers
                    result["steps"][f"{cache}-x{prompts}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
                print(cache, prompts, result["steps"][f"{cache}-x{prompts}"], flush=True)
                result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                json.dump(result, open(a.out, "w"), indent=1)  # so far: a timeout keeps what finished
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    json.dump(result, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
