#!/usr/bin/env python3
"""Peer for loom's tokenizer benchmark: HF `tokenizers` (Rust) encoding the same text on one thread.

    TOKENIZERS_PARALLELISM=false python3 bench/hf_tokenizers_speed.py TOKENIZER.json TEXT.jsonl [--ids OUT]

TEXT.jsonl holds one JSON string per line (bench/make_tokenizer_text.py). Times, best of three:
encode_batch over all lines (one thread: TOKENIZERS_PARALLELISM=false), and encode line by line
(adds Python's per-call cost). No special tokens, as `loom tokenize --no-special`. --ids writes the
ids, one JSON array per line, for comparison with loom's.
"""
import argparse
import json
import os
import sys
import time

import tokenizers
from tokenizers import Tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer")
    ap.add_argument("text")
    ap.add_argument("--ids")
    args = ap.parse_args()
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() not in ("false", "0"):
        sys.exit("hf_tokenizers_speed: set TOKENIZERS_PARALLELISM=false so encode_batch runs on one thread")
    lines = [json.loads(line) for line in open(args.text, encoding="utf-8") if line.strip()]
    total_bytes = sum(len(t.encode("utf-8")) for t in lines)
    start = time.perf_counter()
    tok = Tokenizer.from_file(args.tokenizer)
    load_s = time.perf_counter() - start
    best_batch = best_loop = float("inf")
    for _ in range(3):
        tok = Tokenizer.from_file(args.tokenizer)  # a cold word cache each time, as loom's runs
        start = time.perf_counter()
        batch = tok.encode_batch(lines, add_special_tokens=False)
        best_batch = min(best_batch, time.perf_counter() - start)
        tok = Tokenizer.from_file(args.tokenizer)
        start = time.perf_counter()
        for t in lines:
            tok.encode(t, add_special_tokens=False)
        best_loop = min(best_loop, time.perf_counter() - start)
    tokens = sum(len(e.ids) for e in batch)
    print(json.dumps({"tokenizers": tokenizers.__version__, "lines": len(lines), "bytes": total_bytes, "tokens": tokens,
                      "load_s": load_s, "encode_batch_s": best_batch, "encode_batch_mb_s": total_bytes / best_batch / 1e6,
                      "encode_loop_s": best_loop, "encode_loop_mb_s": total_bytes / best_loop / 1e6}))
    if args.ids:
        with open(args.ids, "w") as f:
            for e in batch:
                f.write(json.dumps(e.ids, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
