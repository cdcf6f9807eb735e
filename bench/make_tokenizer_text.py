#!/usr/bin/env python3
"""Writes the tokenizer benchmark's input: about SIZE MB of mixed text (English prose, code,
Cyrillic, CJK, emoji, digits, whitespace runs), one JSON string per line, deterministic.

    python3 bench/make_tokenizer_text.py OUT.jsonl [SIZE_MB]   (default 4)
"""
import json
import random
import sys

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an they you "
         "were her she there been one all we their has would when what if more no out so said who can about up time").split()
CYRILLIC = "быстрая коричневая лиса прыгает через ленивую собаку и все такое прочее".split()
CJK = "自然语言处理是人工智能的一个重要方向日本語の文章も少し混ぜます한국어도조금".strip()
CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { s += a[i]; }", "if err != nil {\n\treturn err\n}",
        "const xs = items.map((it) => it.value ?? 0);", "SELECT name, COUNT(*) FROM t GROUP BY name;"]
EMOJI = ["🎉", "🚀", "👍🏽", "👨‍👩‍👧", "🇯🇵", "🙂"]


def pseudo_words(rng, n):
    # Made-up words with a Zipf-like frequency, so most words repeat (as in real text) and a long
    # tail does not (word caches see misses, as they would on real text).
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "st", "tr", "pl", "gr", "sh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]
    words = []
    while len(words) < n:
        words.append("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 4))))
    cumulative, total = [], 0.0
    for rank in range(n):
        total += 1.0 / (rank + 1)
        cumulative.append(total)
    return words, cumulative


def line(rng, vocab):
    kind = rng.random()
    if kind < 0.5:
        words = [rng.choice(WORDS) if rng.random() < 0.4 else rng.choices(vocab[0], cum_weights=vocab[1])[0] for _ in range(rng.randint(5, 60))]
        words[0] = words[0].capitalize()
        text = " ".join(words) + rng.choice([".", "?", "!", "", "'s done."])
    elif kind < 0.65:
        text = "\n".join(rng.choice(CODE) for _ in range(rng.randint(1, 4)))
    elif kind < 0.75:
        text = " ".join(rng.choice(CYRILLIC) for _ in range(rng.randint(5, 30)))
    elif kind < 0.83:
        start = rng.randint(0, len(CJK) - 10)
        text = CJK[start:start + rng.randint(5, 30)]
    elif kind < 0.9:
        text = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(rng.randint(3, 20)))
    elif kind < 0.95:
        text = "### PROMPT: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "\n### OUTPUT: " + rng.choice(EMOJI) * rng.randint(1, 3)
    else:
        text = rng.choice(["  ", "\t", "\n\n", "    "]).join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    return text


def main():
    out = sys.argv[1]
    size = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    rng = random.Random(20261129)
    vocab = pseudo_words(rng, 50000)
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        while written < size * 1e6:
            text = line(rng, vocab)
            written += len(text.encode("utf-8"))
            f.write(json.dumps(text, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
