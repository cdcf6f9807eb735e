"""Writes bench/bench-data.jsonl: N samples (default 200) of BYTES printable bytes (default 1100), so
every row of the byte tokenizer fills max_length = 1024 tokens (the 8B benchmarks' data; 4200 bytes
fill rows of 4096).
    python3 bench/make_bench_data.py [N [BYTES]]"""
import json
import random
import sys

rng = random.Random(0)
chars = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,"
with open("bench/bench-data.jsonl", "w") as f:
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
        f.write(json.dumps({"text": "".join(rng.choice(chars) for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1100))}) + "\n")
