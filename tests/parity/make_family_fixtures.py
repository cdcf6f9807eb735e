#!/usr/bin/env python3
"""Writes HF parity fixtures for the ten families of issue 68, reusing make_fixtures.py's helpers:

    python3 tests/parity/make_family_fixtures.py OUT_DIR [--only NAME]...

gpt_neox, olmoe, granite, cohere, stablelm, starcoder2, gemma2, qwen2_moe, deepseek_v3, gpt_oss: tiny
random fp32 models (vocabulary 320, hidden 64, 4 heads, eager attention, initializer_range 0.25, norm
weights and every bias moved off their defaults) whose settings make each family's peculiarity show in
the logits. Each OUT_DIR/<family>/ gets
    config.json, model.safetensors      the base model (save_pretrained)
    inputs.json, logits.safetensors     as make_fixtures.py (2 x 12, row 2 left-padded by 3)
    greedy.json                         "new_tokens" [2, 12]: greedy through transformers' cache, equal to recomputing
    adapter/, logits_adapter.safetensors PEFT LoRA r=8 (random A and B) on every nn.Linear inside the decoder
                                        layers (attention, MLP, shared experts, routers that are Linears), 3 AdamW steps
    facts.json                          model/config classes, versions, layer 0's tensors as saved and as held in
                                        memory, the globals, the adapter's targets, every sensitivity measured
and the mixtures of experts, where transformers supports them, aux.json (loss with the router term) and
adapter-experts/ + logits_adapter_experts.safetensors + merged_experts.safetensors (PEFT target_parameters
on the stacked experts; skipped with a warning where this PEFT cannot).

A family that fails is reported and the others still run; the exit status is 1 if any failed. Before a
fixture is written it must be sensitive: perturbing any one kind of parameter (layer indices as *) moves
the real logits by > 1e-3, doubling position_ids moves them by > 1e-2, and each family's own mistakes
(below, FAMILIES' "checks") move them too, so a wrong C++ implementation cannot pass by accident.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import copy
import dataclasses
import inspect
import json
import re
import struct
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import make_fixtures as mf  # noqa: E402  (its helpers: inputs, logits, saving, greedy, adapters)

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

mf.GREEDY_TOKENS = 12  # 12 prompt + 12 new tokens: windows of 4 and 5 wrap several times in the cache
IS_MOE = False  # set per family; load_base below then asks for the exact per-expert loop


class FamilyError(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise FamilyError(msg)


def load_base(model_dir):
    """mf.load_base, plus experts_implementation="eager" for a mixture of experts: the reloaded model must
    reproduce the saved logits to 1e-6, so it has to run the same per-expert loop as the model that wrote
    them (a batched kernel rounds differently)."""
    kw = {("dtype" if mf.TF_MAJOR >= 5 else "torch_dtype"): torch.float32}
    if IS_MOE:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), attn_implementation="eager", local_files_only=True, experts_implementation="eager", **kw)
        except (TypeError, ValueError):  # a version that does not take it (or not for this model)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", local_files_only=True, **kw)
            model.config._experts_implementation = "eager"
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", local_files_only=True, **kw)
    return model.eval()


mf.load_base = load_base  # mf.train_adapter / make_adapter look it up through the module

# ---------------------------------------------------------------------------------------------------
# The families. "kw" goes to the config class (a key it does not declare is dropped with a warning, so no
# stray key lands in config.json); "after" is set on the config once built (OLMoE: see there); "rot" is
# the rotary width each head must get (checked against the rotary embedding's inv_freq); "checks" name
# the family's own mistakes (MISTAKES below). Expert widths (24, 40) differ from hidden (64) so a stacked
# tensor's axes can be told apart in facts.json.
# ---------------------------------------------------------------------------------------------------
BASE = dict(vocab_size=mf.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
            initializer_range=0.25, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def rope(theta, **extra):
    return {"rope_type": "default", "rope_theta": theta, **extra}


def yarn(theta, **extra):
    # factor 4 over an original context of 32 = max_position_embeddings 128 / 32, so transformers' implicit
    # factor agrees with the explicit one (DeepSeek's yarn takes max_position_embeddings / original).
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
            "rope_theta": theta, **extra}


FAMILIES = {
    # Pythia: fused query_key_value laid out [heads, 3, head_dim], rotary on the first 25% of each head
    # (4 of 16 dims), LayerNorms with bias, two norms feeding attention and MLP in parallel, gelu MLP.
    "gpt_neox": dict(model="GPTNeoXForCausalLM", config="GPTNeoXConfig", rot=4, checks=["sequential residual"],
                     kw=dict(BASE, intermediate_size=256, hidden_act="gelu", layer_norm_eps=1e-5, use_parallel_residual=True,
                             attention_bias=True, tie_word_embeddings=False, rope_parameters=rope(10000.0, partial_rotary_factor=0.25))),
    # OLMoE: RMSNorm q/k norms over the whole projected width, softmax top-2 of 8 experts, not renormalised.
    # num_key_value_heads is set after construction: one transformers 5 OlmoeConfig only runs the base
    # __post_init__ when it is left None.
    "olmoe": dict(model="OlmoeForCausalLM", config="OlmoeConfig", rot=16, checks=["no q/k norm", "one expert a token"],
                  after=dict(num_key_value_heads=2),
                  kw=dict(BASE, intermediate_size=24, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                          router_aux_loss_coef=0.01, tie_word_embeddings=False, attention_bias=False, rope_parameters=rope(10000.0))),
    # Granite: all four multipliers away from 1 (and the score scale away from 1/sqrt(head_dim) = 0.25).
    "granite": dict(model="GraniteForCausalLM", config="GraniteConfig", rot=16,
                    checks=["embedding_multiplier ignored", "residual_multiplier ignored", "attention_multiplier ignored", "logits_scaling ignored"],
                    kw=dict(BASE, num_key_value_heads=2, intermediate_size=160, rms_norm_eps=1e-6, tie_word_embeddings=False, embedding_multiplier=12.0,
                            residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=4.0, rope_parameters=rope(10000.0))),
    # Cohere (Command R/R+): bias-free LayerNorm, attention and MLP from one norm in parallel, interleaved
    # rotary, per-head q/k LayerNorms, logits times logit_scale, tied head.
    "cohere": dict(model="CohereForCausalLM", config="CohereConfig", rot=16, checks=["logit_scale ignored", "no q/k norm"],
                   kw=dict(BASE, num_key_value_heads=2, intermediate_size=160, layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=True,
                           tie_word_embeddings=True, attention_bias=False, rope_parameters=rope(10000.0))),
    # StableLM 2 (12B-style): LayerNorm with bias, rotary on half of each head, q/k/v biases, per-head q/k
    # LayerNorms (one [head_dim] weight per head), parallel residual from one norm.
    "stablelm": dict(model="StableLmForCausalLM", config="StableLmConfig", rot=8, checks=["no q/k norm"],
                     kw=dict(BASE, num_key_value_heads=2, intermediate_size=160, layer_norm_eps=1e-5, use_qkv_bias=True, qk_layernorm=True,
                             use_parallel_residual=True, partial_rotary_factor=0.5, tie_word_embeddings=False,
                             rope_parameters=rope(10000.0, partial_rotary_factor=0.5))),
    # StarCoder2: LayerNorm with bias, biases everywhere, c_fc/c_proj gelu_pytorch_tanh MLP, window 5 on every layer.
    "starcoder2": dict(model="Starcoder2ForCausalLM", config="Starcoder2Config", rot=16, checks=["window ignored"],
                       kw=dict(BASE, num_key_value_heads=2, intermediate_size=256, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5,
                               use_bias=True, sliding_window=5, tie_word_embeddings=True, rope_parameters=rope(100000.0))),
    # Gemma 2: soft-capped scores and logits (caps low enough to bend them), query_pre_attn_scalar 20 for a
    # head_dim of 24, layer 0 a window of 4 and layer 1 global, four (1 + w) norms a layer, scaled embedding.
    "gemma2": dict(model="Gemma2ForCausalLM", config="Gemma2Config", rot=24,
                   checks=["window ignored", "no score softcap", "no final softcap", "scores scaled by head_dim", "embedding unscaled"],
                   kw=dict(BASE, num_key_value_heads=2, intermediate_size=160, head_dim=24, query_pre_attn_scalar=20, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=10.0, final_logit_softcapping=10.0,
                           hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=rope(10000.0))),
    # Qwen1.5/Qwen2-MoE: shared expert behind a sigmoid gate, q/k/v biases, 8 experts top-2 unrenormalised,
    # layer 1 dense through mlp_only_layers.
    "qwen2_moe": dict(model="Qwen2MoeForCausalLM", config="Qwen2MoeConfig", rot=16, checks=["one expert a token"],
                      kw=dict(BASE, num_hidden_layers=3, num_key_value_heads=2, intermediate_size=160, rms_norm_eps=1e-6, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=False,
                              decoder_sparse_step=1, mlp_only_layers=[1], qkv_bias=True, use_sliding_window=False, router_aux_loss_coef=0.02,
                              tie_word_embeddings=False, rope_parameters=rope(1000000.0))),
    # DeepSeek-V3: MLA with a q LoRA rank, interleaved rotary on 8 of 24 q/k dims, v heads of 12, yarn with
    # mscale_all_dim (scores scaled by mscale^2); sigmoid router with a correction bias, 4 groups of 2
    # experts of which 2 are kept (so the group limit bites), top-2, renormalised, times 2.5; one shared
    # expert; layer 0 dense (first_k_dense_replace 1).
    "deepseek_v3": dict(model="DeepseekV3ForCausalLM", config="DeepseekV3Config", rot=8,
                        checks=["one expert a token", "no group limit", "correction bias ignored", "routed_scaling_factor ignored",
                                "rotary not interleaved"],
                        kw=dict(BASE, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=160, moe_intermediate_size=24,
                                n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4, topk_group=2, num_experts_per_tok=2,
                                first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-6,
                                tie_word_embeddings=False, attention_bias=False,
                                rope_parameters=yarn(10000.0, mscale=1.0, mscale_all_dim=1.0))),
    # gpt-oss: attention sinks, q/k/v/o biases, layer 0 a window of 4 and layer 1 global, yarn (truncate
    # off), 4 experts top-2 with biases, interleaved gate/up columns, clamped SwiGLU (limit lowered to 2
    # where the config carries it, so the clamp bites), router with a bias and softmax over the top-k.
    "gpt_oss": dict(model="GptOssForCausalLM", config="GptOssConfig", rot=16,
                    checks=["window ignored", "no sinks", "gate/up not interleaved", "one expert a token", "no clamp"],
                    kw=dict(BASE, num_key_value_heads=2, head_dim=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=4, layer_types=["sliding_attention", "full_attention"], attention_bias=True, rms_norm_eps=1e-5,
                            router_aux_loss_coef=0.02, tie_word_embeddings=False,
                            rope_parameters=yarn(150000.0, truncate=False))),
}


# ---------------------------------------------------------------------------------------------------
# Mistakes: each returns False where this transformers has nowhere to make it (then it is a warning).
# They run on a deep copy; attributes are set both on the config and on any module holding its own copy.
# ---------------------------------------------------------------------------------------------------
def set_everywhere(model, attr, value):
    hit = False
    if hasattr(model.config, attr):
        setattr(model.config, attr, value)
        hit = True
    for mod in model.modules():
        if attr in vars(mod):
            setattr(mod, attr, value)
            hit = True
    return hit


def attention_modules(model):
    return [m for m in model.modules() if "Attention" in type(m).__name__ and hasattr(m, "scaling")]


def no_qk_norm(model):
    hit = False
    for mod in model.modules():
        for a in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
            if isinstance(getattr(mod, a, None), torch.nn.Module) and not isinstance(getattr(mod, a), torch.nn.Identity):
                setattr(mod, a, torch.nn.Identity())
                hit = True
    return hit


def head_dim_scale(model):
    mods = attention_modules(model)
    for m in mods:
        m.scaling = m.head_dim ** -0.5
    return bool(mods)


def embedding_unscaled(model):
    emb = model.get_input_embeddings()
    if not hasattr(emb, "embed_scale"):
        return False
    if torch.is_tensor(emb.embed_scale):
        emb.embed_scale.fill_(1.0)
    else:
        emb.embed_scale = 1.0
    return True


def no_sinks(model):
    hit = False
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(getattr(mod, "sinks", None), torch.Tensor):
                mod.sinks.fill_(-1e4)
                hit = True
    return hit


def deinterleave_gate_up(model):
    """Reads the fused gate_up columns as [gate | up] halves instead of gpt-oss's alternating gate, up."""
    two_i = 2 * model.config.intermediate_size
    perm = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)])
    hit = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.gate_up_proj_bias"):
                dim = [d for d in range(1, p.dim()) if p.shape[d] == two_i][-1]
                p.copy_(p.index_select(dim, perm))
                hit = True
    return hit


def zero_correction_bias(model):
    bufs = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for b in bufs:
        b.zero_()
    return bool(bufs)


def one_expert(model):
    hit = set_everywhere(model, "top_k", 1)
    return set_everywhere(model, "num_experts_per_tok", 1) or hit


MISTAKES = {  # name: (damage, how far it must move the logits, fatal)
    "sequential residual": (lambda m: set_everywhere(m, "use_parallel_residual", False), 1e-2, True),
    "no q/k norm": (no_qk_norm, 1e-2, True),
    "one expert a token": (one_expert, 1e-2, True),
    "embedding_multiplier ignored": (lambda m: set_everywhere(m, "embedding_multiplier", 1.0), 1e-2, True),
    "residual_multiplier ignored": (lambda m: set_everywhere(m, "residual_multiplier", 1.0), 1e-2, True),
    "attention_multiplier ignored": (head_dim_scale, 1e-2, True),
    "logits_scaling ignored": (lambda m: set_everywhere(m, "logits_scaling", 1.0), 1e-2, True),
    "logit_scale ignored": (lambda m: set_everywhere(m, "logit_scale", 1.0), 1e-2, True),
    "window ignored": (lambda m: set_everywhere(m, "sliding_window", 10**6), 1e-2, True),
    "no score softcap": (lambda m: set_everywhere(m, "attn_logit_softcapping", None), 1e-2, True),
    "no final softcap": (lambda m: set_everywhere(m, "final_logit_softcapping", None), 1e-2, True),
    "scores scaled by head_dim": (head_dim_scale, 1e-2, True),
    "embedding unscaled": (embedding_unscaled, 1e-2, True),
    "no group limit": (lambda m: set_everywhere(m, "topk_group", m.config.n_group), 1e-3, True),
    "correction bias ignored": (zero_correction_bias, 1e-3, True),
    "routed_scaling_factor ignored": (lambda m: set_everywhere(m, "routed_scaling_factor", 1.0), 1e-2, True),
    "rotary not interleaved": (lambda m: set_everywhere(m, "rope_interleave", False), 1e-2, True),
    "no sinks": (no_sinks, 1e-3, True),
    "gate/up not interleaved": (deinterleave_gate_up, 1e-2, True),
    # Where the clamp is hard-coded at 7 it may never bite these activations: reported, not fatal.
    "no clamp": (lambda m: set_everywhere(m, "limit", 1e9) | set_everywhere(m, "swiglu_limit", 1e9), 1e-3, False),
}


# ---------------------------------------------------------------------------------------------------
def declared(cls, key):
    if dataclasses.is_dataclass(cls) and key in {f.name for f in dataclasses.fields(cls)}:
        return True
    return key in inspect.signature(cls.__init__).parameters or key in getattr(cls, "attribute_map", {})


def build_config(spec, warnings):
    cls = getattr(transformers, spec["config"])
    kw = {}
    for k, v in spec["kw"].items():
        if declared(cls, k):
            kw[k] = copy.deepcopy(v)
        else:
            warnings.append(f"{spec['config']} does not declare {k}={v!r}; not passed")
    config = cls(attn_implementation="eager", **kw)
    for k, v in spec.get("after", {}).items():
        setattr(config, k, v)
    # Whatever the constructor did with them, the values asked for are the ones the model must be built
    # with (and config.json then says so): re-set any that came out different, and say so.
    for k, v in kw.items():
        if k == "rope_parameters":
            continue
        if getattr(config, k, None) != v:
            warnings.append(f"config.{k} came out {getattr(config, k, None)!r}, set to {v!r}")
            setattr(config, k, v)
    rp = config.rope_parameters if isinstance(config.rope_parameters, dict) else {}
    nested = [d for d in rp.values() if isinstance(d, dict)] or [rp]  # by layer type, where this version nests them
    for d in nested:
        for k, v in spec["kw"]["rope_parameters"].items():
            if d.get(k) != v:
                warnings.append(f"rope_parameters[{k!r}] came out {d.get(k)!r}, set to {v!r}")
                d[k] = v
    config.rope_parameters = rp
    config._attn_implementation = "eager"
    return config


def perturb(model):
    """Norm weights and biases (and gpt-oss's sinks, DeepSeek's routing correction bias) off their
    initial values, so an implementation that drops or misplaces any of them shows."""
    with torch.no_grad():
        for mod in model.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for pname, p in mod.named_parameters(recurse=False):
                if is_norm or pname.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
                elif pname == "sinks":
                    p.add_(torch.randn_like(p))
            for bname, b in mod.named_buffers(recurse=False):
                if bname == "e_score_correction_bias":
                    b.add_(torch.randn_like(b) * 0.2)


def moved(model, inputs, base, real):
    return (mf.logits_of(model, inputs) - base).abs()[real].max().item()


LAYER_RE = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def parameter_roles(model):
    """Every distinct parameter with layer (and expert / head) indices replaced by *, mapped to its
    instances in the first layer that has it (all heads / experts of that layer together)."""
    groups = {}
    for name, _ in model.named_parameters():
        m = LAYER_RE.search(name)
        role = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        groups.setdefault(role, {}).setdefault(int(m.group(1)) if m else -1, []).append(name)
    return {role: by_layer[min(by_layer)] for role, by_layer in sorted(groups.items())}


def sensitivity(model, spec, inputs, base, real, warnings):
    """Returns {what: max |change of a real logit|} and the list of failures."""
    probe = copy.deepcopy(model)
    params = dict(probe.named_parameters())
    gen = torch.Generator().manual_seed(2)
    deltas, failures = {}, []
    for role, names in parameter_roles(probe).items():
        saved = {n: params[n].detach().clone() for n in names}
        with torch.no_grad():  # x1.5 plus noise: the noise defeats norms that would cancel a pure scale
            for n in names:
                p = params[n]
                rms = p.pow(2).mean().sqrt().clamp(min=0.1)
                p.mul_(1.5).add_(0.1 * rms * torch.randn(p.shape, generator=gen))
        deltas[role] = moved(probe, inputs, base, real)
        with torch.no_grad():
            for n in names:
                params[n].copy_(saved[n])
        if deltas[role] <= 1e-3:
            failures.append(f"perturbing {role} moves the logits by only {deltas[role]:.3g}")
    doubled = dict(inputs, position_ids=inputs["position_ids"] * 2)
    deltas["position_ids doubled"] = (mf.logits_of(model, doubled) - base).abs()[real].max().item()
    if deltas["position_ids doubled"] <= 1e-2:
        failures.append(f"doubling position_ids moves the logits by only {deltas['position_ids doubled']:.3g}")
    for what in spec["checks"]:
        damage, threshold, fatal = MISTAKES[what]
        damaged = copy.deepcopy(model)
        try:
            applied = damage(damaged)
        except Exception as e:  # noqa: BLE001 - an attribute this version lacks or will not take
            warnings.append(f"mistake {what!r} could not be made: {type(e).__name__}: {e}")
            continue
        if not applied:
            warnings.append(f"mistake {what!r} has nothing to act on in this transformers; not checked")
            continue
        deltas[what] = moved(damaged, inputs, base, real)
        if deltas[what] <= threshold:
            (failures if fatal else warnings).append(f"{what} moves the logits by only {deltas[what]:.3g} (needs > {threshold})")
    return deltas, failures


def safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: [v["shape"], v["dtype"]] for k, v in header.items() if k != "__metadata__"}


def layer_linear_names(model):
    """Leaf names of every nn.Linear inside the decoder layers: attention, MLP, shared experts, routers
    that are Linears. Explicit, so PEFT's own all-linear rules (which head it leaves out) do not matter."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and LAYER_RE.search(n + ".")})


def expert_adapter(model, out_dir, inputs, base_logits, warnings):
    """PEFT target_parameters on the stacked experts beside attention's Linears, as mf.make_expert_adapter."""
    if not any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters()):
        warnings.append("no stacked mlp.experts.gate_up_proj in memory: no experts' adapter")
        return
    attn = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".self_attn." in n})
    config = mf.make_lora_config(target_modules=attn, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    try:
        _, losses, delta = mf.make_adapter(out_dir, inputs, base_logits, config, "adapter-experts", "logits_adapter_experts.safetensors")
        merged = PeftModel.from_pretrained(load_base(out_dir), str(out_dir / "adapter-experts")).merge_and_unload()
        tensors = {n: p.detach().contiguous() for n, p in merged.named_parameters() if ".mlp.experts." in n}
        save_file(tensors, str(out_dir / "merged_experts.safetensors"))
        print(f"{out_dir.name}: experts' adapter: loss {losses[0]:.4f}->{losses[-1]:.4f} max|dlogit|={delta:.4f}")
    except (Exception, SystemExit) as e:  # noqa: BLE001 - this PEFT may not wrap these experts
        warnings.append(f"no experts' adapter: {type(e).__name__}: {e}")


def make_family(name, out_dir, inputs):
    global IS_MOE
    spec = FAMILIES[name]
    warnings, facts = [], {"family": name, "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                           "peft_version": peft.__version__, "settings": {k: v for k, v in spec["kw"].items()}}
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        config = build_config(spec, warnings)
        IS_MOE = hasattr(config, "num_experts_per_tok")
        if IS_MOE:
            config._experts_implementation = "eager"  # the per-expert loop, exact in fp32 on the CPU
        torch.manual_seed(0)
        model = getattr(transformers, spec["model"])(config)
        perturb(model)
        model.eval()
        need(model.config._attn_implementation == "eager", f"attention is {model.config._attn_implementation!r}, not eager")
        need(all(p.dtype == torch.float32 for p in model.parameters()), "parameters are not all float32")
        # An all-zero tensor (a router left at its constructor's zeros) would make top-k pick among ties.
        zeros = [n for n, p in model.named_parameters() if not p.detach().abs().max().item() > 0]
        need(not zeros, f"parameters left all zero by init: {zeros}")
        facts.update(model_class=type(model).__name__, config_class=type(config).__name__,
                     layer_types=getattr(config, "layer_types", None), rope_parameters=copy.deepcopy(config.rope_parameters))
        inv = {n: b.numel() for n, b in model.named_buffers() if n.endswith("inv_freq")}
        facts["inv_freq_lengths"] = inv
        need(inv, "no rotary inv_freq buffer found")
        need(all(v * 2 == spec["rot"] for v in inv.values()), f"rotary widths {inv} are not {spec['rot']} (inv_freq of {spec['rot'] // 2})")
        for mod in model.modules():  # what gpt-oss's experts actually clamp at (a hard-coded 7.0 or the config's)
            if hasattr(mod, "limit") and "Expert" in type(mod).__name__:
                facts["experts_alpha_limit"] = [getattr(mod, "alpha", None), mod.limit]
                need(float(mod.limit) == float(getattr(config, "swiglu_limit", mod.limit)),
                     f"experts clamp at {mod.limit} but config.json would say swiglu_limit={getattr(config, 'swiglu_limit', None)}")

        base_logits = mf.logits_of(model, inputs)
        need(torch.isfinite(base_logits).all().item(), "non-finite base logits")
        real = inputs["attention_mask"].bool()
        deltas, failures = sensitivity(model, spec, inputs, base_logits, real, warnings)
        facts["sensitivity"] = deltas
        need(not failures, "the fixture would not catch: " + "; ".join(failures))

        mf.save_model(model, out_dir)
        mf.save_logits(out_dir / "logits.safetensors", base_logits)
        (out_dir / "inputs.json").write_text(json.dumps({k: v.tolist() for k, v in inputs.items()}) + "\n")
        saved = safetensors_header(out_dir / "model.safetensors")
        facts["saved_layer0"] = {k: v for k, v in saved.items() if LAYER_RE.search(k) and LAYER_RE.search(k).group(1) == "0"}
        facts["saved_globals"] = {k: v for k, v in saved.items() if not LAYER_RE.search(k)}
        facts["saved_tensor_count"] = len(saved)
        facts["memory_layer0"] = {n: list(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())
                                  if ".layers.0." in n and not n.endswith("inv_freq")}
        facts["config_json"] = json.loads((out_dir / "config.json").read_text())

        greedy = mf.greedy_tokens(model, inputs)
        (out_dir / "greedy.json").write_text(json.dumps({"new_tokens": greedy.tolist()}) + "\n")
        if hasattr(config, "router_aux_loss_coef"):
            try:
                mf.write_moe_extras(model, out_dir, inputs)
            except (Exception, SystemExit) as e:  # noqa: BLE001
                warnings.append(f"no aux.json: {type(e).__name__}: {e}")
        targets = layer_linear_names(model)
        facts["adapter_target_modules"] = targets
        _, losses, delta = mf.make_adapter(out_dir, inputs, base_logits, mf.make_lora_config(target_modules=targets),
                                           "adapter", "logits_adapter.safetensors")
        facts["adapter_layer0"] = {k: v for k, v in safetensors_header(out_dir / "adapter" / "adapter_model.safetensors").items() if ".layers.0." in k}
        if IS_MOE:
            expert_adapter(model, out_dir, inputs, base_logits, warnings)
            if (out_dir / "adapter-experts").is_dir():
                facts["adapter_experts_layer0"] = {k: v for k, v in safetensors_header(
                    out_dir / "adapter-experts" / "adapter_model.safetensors").items() if ".layers.1." in k or ".layers.0." in k}
        print(f"{name}: params={sum(p.numel() for p in model.parameters())} max|logit|={base_logits.abs().max().item():.4f} "
              f"smallest check {min(deltas.values()):.4g} adapter: loss {losses[0]:.4f}->{losses[-1]:.4f} max|dlogit|={delta:.4f}")
        return warnings
    except (Exception, SystemExit) as e:
        facts["error"] = f"{type(e).__name__}: {e}"
        facts["traceback"] = traceback.format_exc()
        raise
    finally:
        facts["warnings"] = warnings
        (out_dir / "facts.json").write_text(json.dumps(facts, indent=1, default=str) + "\n")


def main():
    ap = argparse.ArgumentParser(description="Write HF parity fixtures for issue 68's ten families.")
    ap.add_argument("out_dir", type=Path, help="folder to write <family>/ fixtures into")
    ap.add_argument("--only", choices=list(FAMILIES), action="append", help="this family alone (repeatable)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    inputs = mf.make_inputs()
    failed, warned = [], {}
    for name in FAMILIES:
        if args.only and name not in args.only:
            continue
        try:
            warned[name] = make_family(name, args.out_dir / name, inputs)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - one family's failure must not stop the rest
            print(f"{name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exc()
            failed.append(name)
    for name, ws in warned.items():
        for w in ws or []:
            print(f"{name}: warning: {w}")
    print(f"written: {sorted(warned)}; failed: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
