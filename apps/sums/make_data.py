"""Writes apps/sums/sums.jsonl: every one-digit sum "What is a + b?" (a, b in 0..9, 100 rows) with its answer,
30 of them (a fixed draw) in the split "test", held out of training: `python -m apps.sums.make_data`."""

import json
import random
from pathlib import Path

rows = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a in range(10) for b in range(10)]
held_out = set(random.Random(0).sample(range(len(rows)), 30))
with open(Path(__file__).with_name("sums.jsonl"), "w") as f:
    for i, row in enumerate(rows):
        f.write(json.dumps({**row, "split": "test" if i in held_out else "train"}) + "\n")
