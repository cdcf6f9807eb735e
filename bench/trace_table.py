#!/usr/bin/env python3
"""Where a training step's GPU time goes, from bench/kernel_trace.c's records of one run.

Steps are found by the optimizer: PyTorch's AdamW (and the gradient norm before it) runs as
multi_tensor_apply kernels once per step, so each cluster of them ends a step. Of the steps found,
the first `--skip` warm up and are dropped; the next `--steps` are averaged. Each kernel is sorted
by name into a category; products by time as well: LoRA's rank-16 products each take less than
`--small-us` microseconds, the base model's more (8B at 4 x 1024: base products 50 us and up,
LoRA's 30 us and under). "no kernel running" is the step's wall time (one optimizer end to the
next) minus the union of its kernels' intervals: launch gaps and host waits.
  bench/trace_table.py TRACE.tsv [--label NAME] [--skip 5] [--steps 10] [--small-us 40] [--top 6] [--json OUT]
--top lists each category's costliest kernels (time a step, launches a step, the name cut short).
"""
import argparse, json, re, sys

CATEGORIES = [
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|efficient_attention|cutlassF|cutlassB", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|sm90_|sm80_|splitK|gemv", re.I)),
    ("norm", re.compile(r"rms_norm|norm_kernel|layer_norm", re.I)),
    ("loss", re.compile(r"log_softmax|softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("rotary", re.compile(r"rotary", re.I)),
    ("activation", re.compile(r"silu|sigmoid|swiglu|gelu", re.I)),
    ("copies", re.compile(r"copy|cat|fill|memset|memcpy|index|scatter|gather|transpose|CatArray", re.I)),
]


def category(kind, name, ns, small_ns):
    if kind != "K":
        return "copies"
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            if label == "matmul":
                return "matmul (LoRA, small)" if ns < small_ns else "matmul (base)"
            return label
    return "other elementwise and reductions"


def read(path):
    records = []
    for line in open(path, errors="replace"):
        parts = line.rstrip("\n").split("\t", 4)
        if len(parts) == 5:
            records.append((parts[0], int(parts[1]), int(parts[2]), parts[4]))
    records.sort(key=lambda r: r[1])
    return records


def step_ends(records):
    """End time of each step's last optimizer kernel: optimizer kernels within 1,000 records of one
    another are one step's (an optimizer may cast or copy each parameter between its foreach
    kernels; a step's forward and backward run thousands)."""
    ends, last_index = [], None
    for i, (kind, _, end, name) in enumerate(records):
        if kind == "K" and CATEGORIES[0][1].search(name):
            if last_index is not None and i - last_index <= 1000:
                ends[-1] = end
            else:
                ends.append(end)
            last_index = i
    return ends


def busy_ns(intervals):
    total, current_start, current_end = 0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--label", default="")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--small-us", type=float, default=40.0)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--json")
    a = p.parse_args()
    records = read(a.trace)
    ends = step_ends(records)
    if len(ends) < a.skip + 2:
        sys.exit(f"trace_table: {len(ends)} steps found in {a.trace}; need more than {a.skip + 1}")
    chosen = list(zip(ends[a.skip:], ends[a.skip + 1:]))[: a.steps]
    totals, counts, wall, busy = {}, {}, 0, 0
    by_name = {}
    for begin, end in chosen:
        inside = [r for r in records if r[1] >= begin and r[2] <= end]
        wall += end - begin
        busy += busy_ns([(r[1], r[2]) for r in inside])
        for kind, start, stop, name in inside:
            c = category(kind, name, stop - start, a.small_us * 1e3)
            totals[c] = totals.get(c, 0) + (stop - start)
            counts[c] = counts.get(c, 0) + 1
            key = (c, name)
            t, k = by_name.get(key, (0, 0))
            by_name[key] = (t + stop - start, k + 1)
    n = len(chosen)
    wall_ms, idle_ms = wall / n / 1e6, (wall - busy) / n / 1e6
    rows = sorted(((c, t / n / 1e6, counts[c] / n) for c, t in totals.items()), key=lambda r: -r[1])
    print(f"| {a.label}: one step, mean of {n} | ms | share | kernels |")
    print("|---|---:|---:|---:|")
    for c, ms, k in rows:
        print(f"| {c} | {ms:.2f} | {100 * ms / wall_ms:.1f}% | {k:.0f} |")
    print(f"| no kernel running | {idle_ms:.2f} | {100 * idle_ms / wall_ms:.1f}% | - |")
    print(f"| the step (optimizer end to optimizer end) | {wall_ms:.2f} | 100% | {sum(k for _, _, k in rows):.0f} |")
    if a.top > 0:
        print()
        for c, _, _ in rows:
            named = sorted(((t, k, name) for (cat, name), (t, k) in by_name.items() if cat == c), reverse=True)[: a.top]
            for t, k, name in named:
                short = re.sub(r"\s+", " ", name)[:110]
                print(f"  {c}: {t / n / 1e6:7.2f} ms, {k / n:5.0f} a step  {short}")
    if a.json:
        json.dump({"label": a.label, "steps": n, "wall_ms": wall_ms, "idle_ms": idle_ms,
                   "categories": {c: {"ms": ms, "kernels": k} for c, ms, k in rows}}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
