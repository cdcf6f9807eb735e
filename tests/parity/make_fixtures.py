#!/usr/bin/env python3
"""Writes HF parity fixtures for loom: four tiny random-init models, their logits, and PEFT LoRA
adapters trained a few steps, all fp32 on CPU with eager attention.

    python3 tests/parity/make_fixtures.py OUT_DIR [--only NAME]

For each of OUT_DIR/llama, OUT_DIR/llama3-rope, OUT_DIR/qwen2, OUT_DIR/qwen3 (per-head q/k
RMSNorm, a head_dim that is not hidden_size / heads), OUT_DIR/mistral-window (every layer attends
over a sliding window of 5, shorter than the inputs) and OUT_DIR/qwen2-window (layer 0 global,
layer 1 a window of 4) and OUT_DIR/gemma3 (Gemma 3's text model: a local layer of window 5 and a
global one, rotary theta 10k locally and 1M with linear scaling globally, query_pre_attn_scalar 20
for a head_dim of 24, (1 + w) norms around both halves of each layer, GeGLU), OUT_DIR/olmo2
(norms after attention and the MLP only, q/k norms across every head), OUT_DIR/mixtral (4 experts, top-2)
and OUT_DIR/qwen3_moe (8 experts, top-2 renormalised, its middle layer dense through mlp_only_layers),
whose adapter is on attention, with aux.json (the loss with the router's auxiliary term),
adapter-experts/ (PEFT's target_parameters on every expert) and merged_experts.safetensors (the
stacked experts with that adapter merged), OUT_DIR/llama-yarn (a yarn
rotary, factor 4 over an original context of 32) and OUT_DIR/phi3 (fused qkv_proj and gate_up_proj,
rotary over 12 of each head's 16 dimensions, longrope whose long factors the 12 inputs take, past an
original context of 8, a window of 6; its adapter on the fused projections as PEFT targets them):
    config.json, model.safetensors      the base model (save_pretrained)
    inputs.json                         input_ids, attention_mask, position_ids (2 x 12, row 2 left-padded)
    logits.safetensors                  "logits" [2, 12, 320] float32, base model
    adapter/                            PEFT LoRA r=8 on q,k,v,o,gate,up,down, 3 AdamW steps
    logits_adapter.safetensors          "logits" with that adapter
for the windowed models and the mixtures of experts:
    greedy.json                         "new_tokens" [2, 10]: transformers' greedy generation after
                                        inputs.json's rows (its cache keeps a local layer's window)
and for llama only:
    adapter-rslora/                     rsLoRA r=4 on all-linear, trained the same way
    logits_adapter_rslora.safetensors

Deterministic (fixed seeds); needs torch, transformers, peft, safetensors; never touches the network.
"""
import os

# Everything is built locally; make any accidental hub lookup fail instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import copy
import dataclasses
import inspect
import json
import sys
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB = 320
SEQ = 12
PAD = 3  # left padding of the second row
TRAIN_STEPS = 3
GREEDY_TOKENS = 10  # past the windows: the 12 inputs and these wrap a local layer's cache several times
LR = 1e-2
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
# Phi-3's longrope over a rotary of 12 of the head's 16 dimensions (6 frequencies): the 12 inputs
# pass the original context of 8, so transformers takes the long factors (and so must loom).
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
}
PHI3_LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
TF_MAJOR = int(transformers.__version__.split(".")[0])


def fail(msg):
    print(f"make_fixtures: {msg}", file=sys.stderr)
    sys.exit(1)


def uses_rope_parameters(config_cls):
    """transformers 5 keeps rope_theta and the scaling in one `rope_parameters` field (and saves it
    under that key in config.json); transformers 4 takes `rope_theta` and `rope_scaling` apart."""
    if dataclasses.is_dataclass(config_cls):
        if "rope_parameters" in {f.name for f in dataclasses.fields(config_cls)}:
            return True
    return "rope_parameters" in inspect.signature(config_cls.__init__).parameters


def rope_kwargs(config_cls, theta, scaling=None):
    """Constructor arguments for the RoPE settings, in the form the installed version uses."""
    if uses_rope_parameters(config_cls):
        params = dict(scaling) if scaling else {"rope_type": "default"}
        params["rope_theta"] = theta
        return {"rope_parameters": params}, "rope_parameters"
    kwargs = {"rope_theta": theta}
    if scaling:
        kwargs["rope_scaling"] = dict(scaling)
    return kwargs, "rope_scaling"


def make_config(name):
    """Returns (model class, config, rope key used, expected rope settings)."""
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="eager",
        # Large enough that attention is peaked and every part of it shows in the logits: at the
        # usual 0.02 the scores are near zero, the softmax near uniform, and dropping rotary
        # entirely moved the logits by 4e-3 (check_sensitive holds each mistake to 100x the tests'
        # 1e-4 tolerance).
        initializer_range=0.25,
    )
    if name in ("llama", "llama3-rope", "llama-yarn"):
        theta, scaling = {"llama": (10000.0, None), "llama3-rope": (500000.0, LLAMA3_SCALING), "llama-yarn": (10000.0, YARN_SCALING)}[name]
        rope, key = rope_kwargs(LlamaConfig, theta, scaling)
        config = LlamaConfig(rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, **shape, **rope)
        return LlamaForCausalLM, config, key, {"rope_theta": theta, **(scaling or {})}
    if name == "qwen2":
        rope, key = rope_kwargs(Qwen2Config, 1000000.0)
        config = Qwen2Config(rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, **shape, **rope)
        return Qwen2ForCausalLM, config, key, {"rope_theta": 1000000.0}
    if name == "qwen3":
        rope, key = rope_kwargs(Qwen3Config, 1000000.0)
        config = Qwen3Config(rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, head_dim=24, attention_bias=False,
                             **shape, **rope)
        return Qwen3ForCausalLM, config, key, {"rope_theta": 1000000.0}
    if name == "mistral-window":
        rope, key = rope_kwargs(MistralConfig, 10000.0)
        config = MistralConfig(rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=5, **shape, **rope)
        return MistralForCausalLM, config, key, {"rope_theta": 10000.0}
    if name == "qwen2-window":
        rope, key = rope_kwargs(Qwen2Config, 10000.0)
        config = Qwen2Config(rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                             **shape, **rope)
        kinds = set(getattr(config, "layer_types", None) or [])
        if kinds != {"full_attention", "sliding_attention"}:
            fail(f"qwen2-window: layer_types {getattr(config, 'layer_types', None)} are not one global and one sliding layer")
        return Qwen2ForCausalLM, config, key, {"rope_theta": 10000.0}
    if name == "gemma3":
        local, full = {"rope_type": "default", "rope_theta": 10000.0}, {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
        if uses_rope_parameters(Gemma3TextConfig):
            rope = {"rope_parameters": {"sliding_attention": local, "full_attention": full}}
        else:
            rope = {"rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 10000.0}
        config = Gemma3TextConfig(rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=24, query_pre_attn_scalar=20, sliding_window=5,
                                  layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh", **shape, **rope)
        return Gemma3ForCausalLM, config, "rope_parameters" if "rope_parameters" in rope else "rope_scaling", {}
    if name == "olmo2":
        rope, key = rope_kwargs(Olmo2Config, 500000.0)
        config = Olmo2Config(rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, **shape, **rope)
        return Olmo2ForCausalLM, config, key, {"rope_theta": 500000.0}
    if name == "phi3":
        if uses_rope_parameters(Phi3Config):
            rope = {"rope_parameters": {**PHI3_LONGROPE, "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
        else:
            rope = {"rope_theta": 10000.0, "rope_scaling": {"type": "longrope", **{k: v for k, v in PHI3_LONGROPE.items() if k != "rope_type"}}}
        config = Phi3Config(rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=6, partial_rotary_factor=0.75,
                            original_max_position_embeddings=8, pad_token_id=0, **shape, **rope)
        return Phi3ForCausalLM, config, "rope_parameters" if "rope_parameters" in rope else "rope_scaling", dict(PHI3_LONGROPE)
    if name == "mixtral":
        rope, key = rope_kwargs(MixtralConfig, 1000000.0)
        moe_shape = dict(shape, intermediate_size=48)
        config = MixtralConfig(rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
                               router_aux_loss_coef=0.02, router_jitter_noise=0.0, **moe_shape, **rope)
        return MixtralForCausalLM, config, key, {"rope_theta": 1000000.0}
    if name == "qwen3_moe":
        # Three layers: sparse, dense (mlp_only_layers), sparse; eight experts, top-2 renormalised.
        rope, key = rope_kwargs(Qwen3MoeConfig, 1000000.0)
        moe_shape = dict(shape, num_hidden_layers=3)
        config = Qwen3MoeConfig(rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, head_dim=24, attention_bias=False,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[1], router_aux_loss_coef=0.02, **moe_shape, **rope)
        return Qwen3MoeForCausalLM, config, key, {"rope_theta": 1000000.0}
    raise ValueError(name)


def make_inputs():
    torch.manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, SEQ), dtype=torch.long)
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, :PAD] = 0
    input_ids[1, :PAD] = 0
    # What HF generation derives for left padding; passed explicitly so nothing depends on a default.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def logits_of(model, inputs):
    model.eval()
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    return out.logits.detach().to(torch.float32).contiguous()


def save_logits(path, logits):
    save_file({"logits": logits}, str(path))


def max_diff(a, b):
    return (a - b).abs().max().item()


def save_model(model, out_dir):
    # transformers 4 needs safe_serialization=True; 5 only writes safetensors and has no such argument.
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(str(out_dir), **kwargs)
    for f in ("config.json", "model.safetensors"):
        if not (out_dir / f).is_file():
            fail(f"{out_dir / f} was not written")


def load_base(model_dir):
    # Fresh from disk so every adapter starts from identical base weights and nothing leaks between them.
    dtype_kw = "dtype" if TF_MAJOR >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation="eager", local_files_only=True, **{dtype_kw: torch.float32}
    )
    return model.eval()


def check_rope(model, model_dir, expected):
    """The saved config.json must carry the RoPE settings, under whichever key this version writes
    (Gemma 3's: one setting a kind of layer, or transformers 4's rope_local_base_freq beside them)."""
    saved = json.loads((model_dir / "config.json").read_text())
    if not expected:
        kinds = saved.get("rope_parameters") or {}
        if not ({"sliding_attention", "full_attention"} <= set(kinds) or "rope_local_base_freq" in saved):
            fail(f"{model_dir}/config.json: no rotary settings for each kind of layer (saved: {kinds})")
        return
    rope = saved.get("rope_parameters") or saved.get("rope_scaling") or {}
    for k, v in expected.items():
        got = rope.get(k, saved.get(k)) if k == "rope_theta" else rope.get(k)
        if got != v:
            fail(f"{model_dir}/config.json: rope {k} is {got!r}, expected {v!r} (saved: {rope})")
    rope_type = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
    want_type = expected.get("rope_type", "default")
    if rope_type is not None and rope_type != want_type:
        fail(f"{model_dir}: rotary embedding runs rope_type {rope_type!r}, expected {want_type!r}")


def check_sensitive(model, inputs, base_logits, name):
    """Mistakes an implementation could make must move the logits far past the C++ tests' 1e-4:
    no rotary embedding, a doubled score scale, k and v swapped. Returns the smallest change."""
    real = inputs["attention_mask"].bool().unsqueeze(-1).expand_as(base_logits)
    modeling = sys.modules[type(model).__module__]

    def no_rotary(m):
        modeling.apply_rotary_pos_emb = lambda q, k, *args, **kwargs: (q, k)

    def doubled_scale(m):
        for layer in m.model.layers:
            layer.self_attn.scaling *= 2

    def swapped_kv(m):
        with torch.no_grad():
            for layer in m.model.layers:
                if hasattr(layer.self_attn, "qkv_proj"):  # Phi-3: k's and v's rows of the fused projection
                    w = layer.self_attn.qkv_proj.weight
                    kv = m.config.num_key_value_heads * layer.self_attn.head_dim
                    q = w.shape[0] - 2 * kv
                    w.copy_(torch.cat([w[:q], w[q + kv:], w[q:q + kv]]))
                    continue
                k, v = layer.self_attn.k_proj, layer.self_attn.v_proj
                k.weight, v.weight = v.weight, k.weight
                if k.bias is not None:
                    k.bias, v.bias = v.bias, k.bias

    def no_qk_norm(m):
        for layer in m.model.layers:
            layer.self_attn.q_norm = torch.nn.Identity()
            layer.self_attn.k_norm = torch.nn.Identity()

    def no_window(m):
        m.config.sliding_window = 10**6

    def head_dim_scale(m):
        for layer in m.model.layers:
            layer.self_attn.scaling = m.config.head_dim**-0.5

    def unscaled_embedding(m):
        scale = m.model.embed_tokens.embed_scale
        if torch.is_tensor(scale):
            scale.fill_(1.0)
        else:
            m.model.embed_tokens.embed_scale = 1.0

    def short_factors_only(m):  # longrope's short factors past the original context
        rope = getattr(m.config, "rope_parameters", None) or m.config.rope_scaling
        rope["long_factor"] = list(rope["short_factor"])

    def plain_norm_weights(m):  # w where the model takes 1 + w
        with torch.no_grad():
            for pname, p in m.named_parameters():
                if pname.endswith("norm.weight"):
                    p.add_(-1.0)

    def swapped_gate_up(m):  # each expert's gate rows taken for its up rows (w1 and w3 confused)
        with torch.no_grad():
            for layer in m.model.layers:
                experts = getattr(layer.mlp, "experts", None)
                if experts is not None:
                    w = experts.gate_up_proj
                    half = w.shape[1] // 2
                    w.copy_(torch.cat([w[:, half:], w[:, :half]], 1))

    def top_one(m):  # the router's first pick alone
        for layer in m.model.layers:
            for part in (layer.mlp, getattr(layer.mlp, "gate", None)):
                if part is not None and hasattr(part, "top_k"):
                    part.top_k = 1

    mistakes = [("no rotary embedding", no_rotary), ("doubled score scale", doubled_scale), ("k and v swapped", swapped_kv)]
    if hasattr(model.config, "num_experts_per_tok"):
        mistakes += [("experts' gate and up swapped", swapped_gate_up), ("one expert a token", top_one)]
    if getattr(model.config, "query_pre_attn_scalar", None):
        mistakes.append(("scores scaled by head_dim, not query_pre_attn_scalar", head_dim_scale))
    if hasattr(model.model.embed_tokens, "embed_scale"):
        mistakes.append(("the embedding unscaled", unscaled_embedding))
    if model.config.model_type.startswith("gemma"):
        mistakes.append(("norms of w, not 1 + w", plain_norm_weights))
    if hasattr(model.model.layers[0].self_attn, "q_norm"):
        mistakes.append(("no q/k norm", no_qk_norm))
    if getattr(model.config, "sliding_window", None):
        mistakes.append(("the sliding window ignored", no_window))
    if "long_factor" in (getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}):
        mistakes.append(("longrope's short factors past the original context", short_factors_only))
    smallest = None
    for what, damage in mistakes:
        original = modeling.apply_rotary_pos_emb
        damaged = copy.deepcopy(model)
        damage(damaged)
        try:
            delta = (logits_of(damaged, inputs) - base_logits).abs().masked_select(real).max().item()
        finally:
            modeling.apply_rotary_pos_emb = original
        if delta < 1e-2:
            fail(f"{name}: {what} moves the logits by only {delta:.3g}; the fixture would not catch it")
        smallest = delta if smallest is None else min(smallest, delta)
    return smallest


def greedy_tokens(model, inputs):
    """transformers' greedy generation through its cache, checked against recomputing every
    position per token (no cache), so the fixture holds what the model computes, not a cache's quirk."""
    model.eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=GREEDY_TOKENS, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], generation_config=config)
    cached = out[:, inputs["input_ids"].shape[1]:]
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    recomputed = ids[:, inputs["input_ids"].shape[1]:]
    if cached.shape != recomputed.shape or not torch.equal(cached, recomputed):
        fail(f"greedy generation through the cache {cached.tolist()} differs from recomputing {recomputed.tolist()}")
    return cached


def train_adapter(model_dir, inputs, lora_config, base_logits):
    base = load_base(model_dir)
    reloaded = logits_of(base, inputs)
    if max_diff(reloaded, base_logits) > 1e-6:
        fail(f"{model_dir}: reloaded base differs from the saved logits by {max_diff(reloaded, base_logits):.3g}")

    torch.manual_seed(0)  # init_lora_weights=False draws A and B from the global generator
    model = get_peft_model(base, lora_config)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not trainable or not all(".lora_" in n for n in trainable):
        fail(f"unexpected trainable parameters: {sorted(trainable)[:5]}")
    before = {n: p.detach().clone() for n, p in trainable.items()}

    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(list(trainable.values()), lr=LR)
    model.train()
    losses = []
    for _ in range(TRAIN_STEPS):
        out = model(**inputs, labels=labels, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    model.eval()

    # Both A and B must have moved, or the fixture would not test B's layout.
    frozen = [n for n, p in trainable.items() if torch.equal(p.detach(), before[n])]
    if frozen:
        fail(f"parameters not updated by training: {frozen[:5]}")
    return model, losses


def make_adapter(model_dir, inputs, base_logits, lora_config, adapter_name, logits_name):
    model, losses = train_adapter(model_dir, inputs, lora_config, base_logits)
    logits = logits_of(model, inputs)
    save_logits(model_dir / logits_name, logits)
    adapter_dir = model_dir / adapter_name
    model.save_pretrained(str(adapter_dir))
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not (adapter_dir / f).is_file():
            fail(f"{adapter_dir / f} was not written")

    # Round trip through the files exactly as a consumer would, so the fixture is self-consistent.
    again = logits_of(PeftModel.from_pretrained(load_base(model_dir), str(adapter_dir)), inputs)
    if max_diff(again, logits) > 1e-6:
        fail(f"{adapter_dir}: reloaded adapter differs from its logits by {max_diff(again, logits):.3g}")
    delta = max_diff(logits, base_logits)
    if delta < 1e-3:
        fail(f"{adapter_dir}: adapter barely changes the logits (max {delta:.3g})")
    return logits, losses, delta


def make_lora_config(**overrides):
    kwargs = dict(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,  # random A and B, so B is non-zero from the start
    )
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


MOE_NAMES = ("mixtral", "qwen3_moe")


def write_moe_extras(model, out_dir, inputs):
    """A mixture of experts' training loss with its auxiliary term (output_router_logits), into
    aux.json: "loss" (cross-entropy plus router_aux_loss_coef x aux), "aux_loss" and "ce_loss", over
    inputs.json's rows with their padding masked (labels -100 there). Also the tensor names
    save_pretrained wrote, so the fixture says which layout this transformers puts on disk."""
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    model.eval()
    with torch.no_grad():
        out = model(**inputs, labels=labels, use_cache=False, output_router_logits=True)
        plain = model(**inputs, labels=labels, use_cache=False)
    coef = model.config.router_aux_loss_coef
    if abs(out.loss.item() - (plain.loss.item() + coef * out.aux_loss.item())) > 1e-5:
        fail(f"{out_dir}: loss {out.loss.item()} is not ce {plain.loss.item()} + {coef} x aux {out.aux_loss.item()}")
    (out_dir / "aux.json").write_text(json.dumps({"loss": out.loss.item(), "aux_loss": out.aux_loss.item(), "ce_loss": plain.loss.item(),
                                                  "router_aux_loss_coef": coef}) + "\n")
    from safetensors import safe_open
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        names = sorted(n for n in f.keys() if ".layers.0." in n)
    print(f"{out_dir.name}: layer 0 as saved: {names}")


def make_expert_adapter(out_dir, inputs, base_logits):
    """PEFT's LoRA on every expert through target_parameters (transformers 5's stacked experts),
    beside attention: adapter-experts/ and logits_adapter_experts.safetensors. Printed, not fatal,
    where this PEFT cannot."""
    config = make_lora_config(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    try:
        _, losses, delta = make_adapter(out_dir, inputs, base_logits, config, "adapter-experts", "logits_adapter_experts.safetensors")
        print(f"{out_dir.name}: experts' adapter: loss {losses[0]:.4f}->{losses[-1]:.4f} max|dlogit|={delta:.4f}")
        # Every layer's experts with the adapter merged in (merge_and_unload), so a reader of PEFT's
        # per-expert A and B is checked against PEFT's own sum: merged_experts.safetensors.
        merged = PeftModel.from_pretrained(load_base(out_dir), str(out_dir / "adapter-experts")).merge_and_unload()
        tensors = {n: p.detach().contiguous() for n, p in merged.named_parameters() if ".mlp.experts." in n}
        if not tensors:
            fail(f"{out_dir}: the merged model has no stacked experts")
        save_file(tensors, str(out_dir / "merged_experts.safetensors"))
    except Exception as e:  # noqa: BLE001 - reported, the other fixtures still written
        print(f"{out_dir.name}: no experts' adapter: {type(e).__name__}: {e}")


def make_fixture(name, out_dir, inputs):
    out_dir.mkdir(parents=True, exist_ok=True)
    model_cls, config, rope_key, rope_expected = make_config(name)

    if name in MOE_NAMES:
        config._experts_implementation = "eager"  # the per-expert loop, exact in fp32 on the CPU
    torch.manual_seed(0)
    model = model_cls(config)
    # Fresh init leaves norm weights at one and biases at zero, which would hide mistakes in either.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or pname.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    if model.config._attn_implementation != "eager":
        fail(f"{name}: attention is {model.config._attn_implementation!r}, expected eager")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        fail(f"{name}: parameters are not all float32")

    # Base logits before any PEFT wrapping touches the modules.
    base_logits = logits_of(model, inputs)
    if not torch.isfinite(base_logits).all():
        fail(f"{name}: non-finite base logits")
    sensitivity = check_sensitive(model, inputs, base_logits, name)
    save_model(model, out_dir)
    check_rope(model, out_dir, rope_expected)
    save_logits(out_dir / "logits.safetensors", base_logits)
    serial = {k: v.tolist() for k, v in inputs.items()}
    (out_dir / "inputs.json").write_text(json.dumps(serial) + "\n")
    if getattr(model.config, "sliding_window", None) or name in MOE_NAMES:
        greedy = greedy_tokens(model, inputs)
        (out_dir / "greedy.json").write_text(json.dumps({"new_tokens": greedy.tolist()}) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    if hasattr(model.config, "num_experts_per_tok"):
        write_moe_extras(model, out_dir, inputs)
    del model

    # Phi-3's LoRA on its fused projections, as PEFT targets them: one A, one B over q, k and v. A
    # mixture of experts' on attention (its experts' adapter: write_moe_extras).
    targets = PHI3_LORA_TARGETS if name == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"] if name in MOE_NAMES else list(LORA_TARGETS)
    _, losses, delta = make_adapter(
        out_dir, inputs, base_logits, make_lora_config(target_modules=targets), "adapter", "logits_adapter.safetensors"
    )
    line = (
        f"{name}: params={n_params} max|logit|={base_logits.abs().max().item():.6f} smallest mistake moves a logit {sensitivity:.3f} "
        f"adapter: loss {losses[0]:.4f}->{losses[-1]:.4f} max|dlogit|={delta:.4f}"
    )
    if name == "llama":
        rs = make_lora_config(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True)
        _, rs_losses, rs_delta = make_adapter(
            out_dir, inputs, base_logits, rs, "adapter-rslora", "logits_adapter_rslora.safetensors"
        )
        line += f" rslora: loss {rs_losses[0]:.4f}->{rs_losses[-1]:.4f} max|dlogit|={rs_delta:.4f}"
    if name in MOE_NAMES:
        make_expert_adapter(out_dir, inputs, base_logits)
    print(f"{line} rope key={rope_key}")


def main():
    names = ("llama", "llama3-rope", "llama-yarn", "qwen2", "qwen3", "mistral-window", "qwen2-window", "gemma3", "olmo2", "phi3") + MOE_NAMES
    ap = argparse.ArgumentParser(description="Write HF parity fixtures (tiny llama, llama3-rope, llama-yarn, qwen2, qwen3, mistral-window, qwen2-window, "
                                 "gemma3, olmo2, phi3) for loom.")
    ap.add_argument("out_dir", type=Path, help="folder to write <model>/ fixtures into")
    ap.add_argument("--only", choices=names, action="append", help="write this fixture alone (repeatable)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    inputs = make_inputs()
    for name in names:
        if args.only is None or name in args.only:
            make_fixture(name, args.out_dir / name, inputs)


if __name__ == "__main__":
    main()
