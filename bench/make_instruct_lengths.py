#!/usr/bin/env python3
"""Variable-length training data for bench/run_train_speed.sh (#28): sample lengths like a real
instruction set's, as token counts for HF (--lengths) and as text for loom's bytes tokenizer
(--loom), the same samples in the same order.

    python3 bench/make_instruct_lengths.py --count N --lengths LENGTHS.jsonl --loom DATA.jsonl [--seed S]

Each sample is a prompt and a completion. Their lengths are drawn from log-normal distributions
whose means and medians are those published for a real instruction set (DISTRIBUTION below, with
its source), and kept when the sample's total is within 30 to 2,048 tokens (a truncated draw: the
kept samples' statistics are printed, and are what the benchmark measures).
  LENGTHS.jsonl: {"prompt": P, "completion": C} a line (hf_peft_lora.py --samples).
  DATA.jsonl:    {"q": ..., "a": ...} a line for the pipeline format "Q:{q} A:{a}": with the bytes
                 tokenizer (a BOS, then a token a byte) a sample is exactly P + C tokens, the
                 completion (what follows "A:") exactly C.
"""
import argparse
import json
import math
import random
import statistics

# Prompt and completion lengths in tokens, (mean, median) each: ShareGPT's first turns. The means
# are published in Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention" (SOSP 2023), Figure 11: input 161.31, output 337.99 tokens (OPT tokenizer). The
# medians, 35 and 271, were computed from that paper's artifact (github.com/sosp-ae-39/sosp-ae-astra,
# datasets/sharegpt_opt_text_completion_length.pkl: 84,226 length pairs; the 79,731 whose total is
# under 2,048 give the figure's means exactly). On the real pairs with totals of 30 to 2,048 tokens:
# mean 512, median 379.
DISTRIBUTION = {"prompt": (161.31, 35), "completion": (337.99, 271)}
SOURCE = "ShareGPT first turns, log-normal fits to Kwon et al. 2023"
TEMPLATE_TOKENS = 6  # BOS + "Q:" + " A:" in the bytes tokenizer
SHORTEST, LONGEST = 30, 2048


def log_normal(mean, median):
    """(mu, sigma) of the log-normal with this mean and median: median = e^mu, mean = e^(mu + sigma^2/2)."""
    mu = math.log(median)
    return mu, math.sqrt(2 * math.log(mean / median))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=4000)
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompt, completion = log_normal(*DISTRIBUTION["prompt"]), log_normal(*DISTRIBUTION["completion"])
    samples = []
    while len(samples) < args.count:
        p = max(TEMPLATE_TOKENS + 1, round(rng.lognormvariate(*prompt)))
        c = max(1, round(rng.lognormvariate(*completion)))
        if SHORTEST <= p + c <= LONGEST:
            samples.append((p, c))
    letters = "abcdefghijklmnopqrstuvwxyz "
    with open(args.lengths, "w") as lengths, open(args.loom, "w") as loom:
        for p, c in samples:
            lengths.write(json.dumps({"prompt": p, "completion": c}) + "\n")
            q = "".join(rng.choice(letters) for _ in range(p - TEMPLATE_TOKENS))
            a = "".join(rng.choice(letters) for _ in range(c))
            loom.write(json.dumps({"q": q, "a": a}) + "\n")
    totals = sorted(p + c for p, c in samples)
    def pct(q):
        return totals[min(len(totals) - 1, int(q * len(totals)))]
    # What padding each step's 8 samples (in file order) to their longest costs.
    steps = [totals_step for totals_step in (
        [p + c for p, c in samples[i:i + 8]] for i in range(0, len(samples) - 7, 8))]
    padded_share = sum(sum(s) for s in steps) / sum(8 * max(s) for s in steps)
    print(f"lengths ({SOURCE}): {len(samples)} samples of {totals[0]} to {totals[-1]} tokens, mean "
          f"{statistics.mean(totals):.0f}, median {pct(0.5)}, p90 {pct(0.9)}, p99 {pct(0.99)}; prompts mean "
          f"{statistics.mean(p for p, _ in samples):.0f}, completions mean {statistics.mean(c for _, c in samples):.0f}; "
          f"8 a step: {statistics.mean(sum(s) for s in steps):.0f} real tokens, {100 * padded_share:.0f}% of a padded batch")


if __name__ == "__main__":
    main()
