#!/usr/bin/env python3
"""A reference for loom's 4-bit quantization, written from the QLoRA paper (Dettmers et al. 2023)
and bitsandbytes' documented layout, in plain Python (no numpy, no torch) so it shares no code
with the C++ it checks. Every float32 operation is rounded to float32 explicitly.

Definitions (loom's, matching bitsandbytes' CUDA kernels):
- blocks of `blocksize` consecutive elements of the row-major flattened tensor (the last may be
  short); absmax = max |x| of the block, float32;
- x is normalised as x * (1 / absmax) in float32 (absmax 0 gives NaN, which takes code 0);
- a code is the number of thresholds t with x > t, where the thresholds are the midpoints of
  consecutive code values (a tie takes the lower code); FP4 keeps its sign in bit 3 (x < 0) and
  codes |x| by its magnitude table;
- two codes per byte, the even element in the high nibble; an odd count pads a zero code;
- double quantization: offset = mean(absmax) (float32 of the exact mean); absmax - offset in blocks
  of 256 with their own float32 absmax, coded to 8 bits on the signed dynamic map (nearest value,
  ties to the lower code);
- dequantization: float32(code value * absmax) rounded once to the weight's dtype; a double
  quantized absmax is float32(float32(map[q] * nested_absmax) + offset).

    python3 tests/qlora/reference.py OUT_DIR   # writes the fixtures the C++ tests read
"""
import json
import math
import os
import random
import struct
import sys


def f32(x):
    """x rounded to the nearest float32 (round half to even), as a Python float."""
    if math.isnan(x) or math.isinf(x):
        return x
    return struct.unpack("<f", struct.pack("<f", x))[0]


NF4 = [f32(v) for v in (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                         -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                         0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                         0.7229568362236023, 1.0)]
# bitsandbytes' FP4: sign bit 3; magnitude bits 2-0 of 0, 0.0625, 8, 12, 4, 6, 2, 3, over 12.
FP4_MAGNITUDE = [f32(v / 12.0) for v in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)]
FP4 = FP4_MAGNITUDE + [-v for v in FP4_MAGNITUDE]


def thresholds(sorted_values):
    return [f32((a + b) / 2.0) for a, b in zip(sorted_values, sorted_values[1:])]


NF4_THRESHOLDS = thresholds(NF4)
FP4_ORDER = sorted(range(8), key=lambda i: FP4_MAGNITUDE[i])  # magnitude codes by value
FP4_THRESHOLDS = thresholds([FP4_MAGNITUDE[i] for i in FP4_ORDER])


def dynamic_map():
    """The signed 8-bit dynamic map: for i in 0..6, 2^i values 10^(i-6) x the midpoints of
    linspace(0.1, 1, 2^i + 1), and their negatives; 0 and 1. Computed in double, rounded once."""
    values = [0.0, 1.0]
    for i in range(7):
        n = 2 ** i + 1
        bounds = [0.1 + (1.0 - 0.1) * k / (n - 1) for k in range(n)]
        for a, b in zip(bounds, bounds[1:]):
            v = f32(10.0 ** (i - 6) * (a + b) / 2.0)
            values += [v, -v]
    return sorted(values)


MAP8 = dynamic_map()
MAP8_THRESHOLDS = thresholds(MAP8)


def count_above(x, ts):
    return 0 if math.isnan(x) else sum(1 for t in ts if x > t)


def code4(x, quant_type):
    if quant_type == "nf4":
        return count_above(x, NF4_THRESHOLDS)
    if math.isnan(x):
        return 0
    sign = 8 if x < 0 else 0
    return sign | FP4_ORDER[count_above(abs(x), FP4_THRESHOLDS)]


def blockwise(values, blocksize):
    return [values[i:i + blocksize] for i in range(0, len(values), blocksize)]


def scale(block):
    absmax = max(abs(v) for v in block)
    recip = f32(1.0 / absmax) if absmax > 0 else math.inf
    return absmax, [f32(v * recip) if not (v == 0 and math.isinf(recip)) else math.nan for v in block]


def quantize(values, quant_type, blocksize, double_quant):
    codes, absmax = [], []
    for block in blockwise(values, blocksize):
        m, normalised = scale(block)
        absmax.append(m)
        codes += [code4(x, quant_type) for x in normalised]
    if len(codes) % 2:
        codes.append(code4(0.0, quant_type))
    packed = [(codes[i] << 4) | codes[i + 1] for i in range(0, len(codes), 2)]
    out = {"packed": packed, "absmax": absmax}
    if double_quant:
        offset = f32(math.fsum(absmax) / len(absmax))
        shifted = [f32(a - offset) for a in absmax]
        q, nested = [], []
        for block in blockwise(shifted, 256):
            m, normalised = scale(block)
            nested.append(m)
            q += [count_above(x, MAP8_THRESHOLDS) for x in normalised]
        out.update({"qabsmax": q, "nested_absmax": nested, "offset": offset})
    return out


def dequantize(q, n, quant_type, blocksize):
    table = NF4 if quant_type == "nf4" else FP4
    if "qabsmax" in q:
        absmax = [f32(f32(MAP8[c] * q["nested_absmax"][i // 256]) + q["offset"]) for i, c in enumerate(q["qabsmax"])]
    else:
        absmax = q["absmax"]
    codes = []
    for b in q["packed"]:
        codes += [b >> 4, b & 15]
    return [f32(table[codes[i]] * absmax[i // blocksize]) for i in range(n)]


# --- safetensors, written by hand -------------------------------------------------------------

def write_safetensors(path, tensors, metadata=None):
    formats = {"F32": "<f", "U8": "<B", "BF16": None}
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, values) in tensors.items():
        if dtype == "BF16":  # the upper half of each float32
            blob = b"".join(struct.pack("<f", v)[2:] for v in values)
        else:
            blob = b"".join(struct.pack(formats[dtype], v) for v in values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def bf16(x):
    """x rounded to bfloat16 (round half to even), as a Python float."""
    bits = struct.unpack("<I", struct.pack("<f", f32(x)))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# --- fixtures -----------------------------------------------------------------------------------

def quantized_tensors(key, values, shape, quant_type, blocksize, double):
    """The reference's quantization of `values` as fixture tensors under `key`: codes, scales (or
    the 8-bit scales, nested absmax and offset) and the dequantized values."""
    q = quantize(values, quant_type, blocksize, double)
    out = {key + ".packed": ("U8", [len(q["packed"])], q["packed"])}
    if double:
        out[key + ".qabsmax"] = ("U8", [len(q["qabsmax"])], q["qabsmax"])
        out[key + ".nested_absmax"] = ("F32", [len(q["nested_absmax"])], q["nested_absmax"])
        out[key + ".offset"] = ("F32", [1], [q["offset"]])
    else:
        out[key + ".absmax"] = ("F32", [len(q["absmax"])], q["absmax"])
    out[key + ".dequantized"] = ("F32", shape, dequantize(q, len(values), quant_type, blocksize))
    return out


def cases():
    rnd = random.Random(2023)
    gauss = lambda n, s=1.0: [f32(rnd.gauss(0.0, s)) for _ in range(n)]
    yield "gauss_2048", gauss(2048, 0.02), [32, 64]
    yield "uneven_1001", gauss(1001), [7, 143]                                      # no block divides it; odd count
    yield "zeros_130", [0.0] * 130, [130]                                            # absmax 0
    yield "extremes_300", [f32(v) for v in ([3.0e38, -3.0e38, 1.0e-38, -1.0e-45] * 75)], [300]
    ties = NF4_THRESHOLDS + [-t for t in NF4_THRESHOLDS] + [1.0, -1.0, 0.5, -0.5]   # exactly on thresholds (absmax 1)
    yield "ties_64", [f32(v) for v in (ties + [0.0] * 64)[:64]], [64]
    yield "fp4_edges_64", [f32(v) for v in (FP4_THRESHOLDS + [-t for t in FP4_THRESHOLDS] + [1.0, -0.0, 1e-3, -1e-3] + [0.0] * 64)[:64]], [64]
    yield "many_blocks_20000", gauss(20000, 0.05), [100, 200]                        # 313 blocks of 64: 2 nested blocks, the last short


def tiny_llama(out):
    """A tiny Llama in transformers' bitsandbytes layout (every linear of the decoder layers NF4,
    double-quantized; embedding, norms and head float32), and the same model dequantized as a
    plain float32 folder: what loom loads from the first must compute what it loads from the
    second. Beside them, llama-dequantized-4bit.safetensors: the second folder's linears as this
    reference quantizes them (NF4 double-quantized, FP4 plain), what loom must make of them while
    loading."""
    rnd = random.Random(7)
    hidden, inter, heads, kv, head_dim, vocab, layers = 32, 64, 4, 2, 8, 64, 2
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "num_hidden_layers": layers,
              "vocab_size": vocab, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
    quantization = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                    "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
                    "llm_int8_skip_modules": None}
    gauss = lambda n: [f32(rnd.gauss(0.0, 0.2)) for _ in range(n)]
    dense, packed = {}, {}
    for name, shape in [("model.embed_tokens.weight", [vocab, hidden]), ("lm_head.weight", [vocab, hidden]), ("model.norm.weight", [hidden])]:
        values = gauss(shape[0] * shape[1]) if len(shape) == 2 else [1.0] * shape[0]
        dense[name] = packed[name] = ("F32", shape, values)
    linears = [("self_attn.q_proj", heads * head_dim, hidden), ("self_attn.k_proj", kv * head_dim, hidden),
               ("self_attn.v_proj", kv * head_dim, hidden), ("self_attn.o_proj", hidden, heads * head_dim),
               ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden), ("mlp.down_proj", hidden, inter)]
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[prefix + norm + ".weight"] = packed[prefix + norm + ".weight"] = ("F32", [hidden], [f32(1.0 + 0.1 * rnd.gauss(0, 1)) for _ in range(hidden)])
        for name, rows, cols in linears:
            key = prefix + name + ".weight"
            values = gauss(rows * cols)
            q = quantize(values, "nf4", 64, True)
            dense[key] = ("F32", [rows, cols], dequantize(q, rows * cols, "nf4", 64))
            packed[key] = ("U8", [len(q["packed"]), 1], q["packed"])
            packed[key + ".absmax"] = ("U8", [len(q["qabsmax"])], q["qabsmax"])
            packed[key + ".quant_map"] = ("F32", [16], NF4)
            packed[key + ".nested_absmax"] = ("F32", [len(q["nested_absmax"])], q["nested_absmax"])
            packed[key + ".nested_quant_map"] = ("F32", [256], MAP8)
            state = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [rows, cols], "nested_blocksize": 256,
                                "nested_dtype": "float32", "nested_offset": q["offset"]}).encode()
            packed[key + ".quant_state.bitsandbytes__nf4"] = ("U8", [len(state)], list(state))
    # The reference's own quantization of the dequantized folder's linears, as loom quantizes a
    # full-precision checkpoint while loading it: NF4 double-quantized and FP4 plain, blocks of 64.
    requantized = {}
    for key, (dtype, shape, values) in dense.items():
        if not any(key.endswith(name + ".weight") for name, _, _ in linears):
            continue
        for quant_type, double in (("nf4", True), ("fp4", False)):
            requantized.update(quantized_tensors(f"{key}.{quant_type}", values, shape, quant_type, 64, double))
    write_safetensors(os.path.join(out, "llama-dequantized-4bit.safetensors"), requantized, {"made_by": "tests/qlora/reference.py"})
    for folder, tensors, extra in [("llama-bnb-nf4", packed, {"quantization_config": quantization}), ("llama-dequantized", dense, {})]:
        os.makedirs(os.path.join(out, folder), exist_ok=True)
        with open(os.path.join(out, folder, "config.json"), "w") as f:
            json.dump({**config, **extra}, f, indent=2)
        write_safetensors(os.path.join(out, folder, "model.safetensors"), tensors, {"format": "pt"})


def main(out):
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name, values, shape in cases():
        tensors[name] = ("F32", shape, values)
        for quant_type in ("nf4", "fp4"):
            for blocksize in (64, 128):
                for double in (False, True):
                    key = f"{name}.{quant_type}.{blocksize}.{'dq' if double else 'plain'}"
                    tensors.update(quantized_tensors(key, values, shape, quant_type, blocksize, double))
    tensors["map8"] = ("F32", [256], MAP8)
    write_safetensors(os.path.join(out, "quantize.safetensors"), tensors, {"made_by": "tests/qlora/reference.py"})
    tiny_llama(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "qlora"))
