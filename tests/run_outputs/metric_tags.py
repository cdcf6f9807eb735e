"""The TensorBoard tags a metrics.jsonl row stands for, as docs/metrics.md specifies them; written
apart from loom's C++ so the readers below check loom against the spec, not against itself."""
import math


def scalars(row):
    """[(tag, value)] of one row: every number but step and time, grouped train/ or eval/."""
    is_eval = row.get("eval") is True
    group = "eval/" if is_eval else "train/"
    out = []
    for key, value in row.items():
        if key in ("step", "time", "eval"):
            continue
        name = key[len("eval_"):] if is_eval and key.startswith("eval_") else key
        scale = 1.0
        if name.endswith("_bytes"):
            name, scale = name[: -len("_bytes")] + "_gib", 1.0 / 2**30
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out.append((group + name, value * scale))
        elif isinstance(value, dict):
            out.extend((group + name + "/" + part, v * scale) for part, v in value.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool))
    return out


def read_rows(path):
    import json
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows):
    """{tag: [(step, value)]} over the rows, with non-finite values left out."""
    out = {}
    for row in rows:
        for tag, value in scalars(row):
            out.setdefault(tag, [])
            if math.isfinite(value):
                out[tag].append((row["step"], value))
    return out
