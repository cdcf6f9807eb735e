#!/usr/bin/env python3
"""Where a decode step's GPU time goes, from bench/kernel_trace.c's records of one `loom generate`.

A step runs the attention kernel once a layer, so every `--layers`-th attention launch starts a
step (layer 0's). The last `--steps` whole steps are averaged: per kernel name, its time and
launches a step; "no kernel running" is the step's span minus the union of its kernels' intervals
(launch gaps, graph replay and host waits). Overlapped (programmatic dependent) launches make
kernels overlap, so the names' times may sum past the span.
  bench/trace_decode.py TRACE.tsv --layers 32 [--steps 100] [--label NAME]
"""
import argparse, re, sys

from trace_table import busy_ns, read  # bench/: the same records, the same union of intervals


def short(name):
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*$", "", name) if not name.startswith("(") else name
    return name[:90]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--label", default="")
    a = p.parse_args()
    records = read(a.trace)
    starts = [r[1] for r in records if r[0] == "K" and "decode_attention" in r[3]]
    step_starts = starts[:: a.layers]
    if len(step_starts) < 3:
        sys.exit(f"trace_decode: {a.trace}: {len(starts)} attention launches, too few steps for {a.layers} layers")
    steps = min(a.steps, len(step_starts) - 2)
    begin, end = step_starts[-steps - 1], step_starts[-1]
    window = [r for r in records if begin <= r[1] < end]
    per_name = {}
    for kind, s, e, name in window:
        key = short(name) if kind == "K" else f"{kind}: {name}"
        t, n = per_name.get(key, (0, 0))
        per_name[key] = (t + e - s, n + 1)
    busy = busy_ns([(s, min(e, end)) for _, s, e, _ in window])
    span = (end - begin) / steps
    print(f"## {a.label}: {steps} steps, {span / 1e3:.1f} us a step, no kernel running {(end - begin - busy) / steps / 1e3:.1f} us a step")
    print("| kernel | us a step | launches a step | us a launch |")
    print("|---|---:|---:|---:|")
    for key, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0]):
        print(f"| {key} | {t / steps / 1e3:.1f} | {n / steps:.2f} | {t / n / 1e3:.2f} |")


if __name__ == "__main__":
    main()
