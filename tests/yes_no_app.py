"""A dataset app for tests/test_evaluation.py (imported by name, by the run and by the dataset server): a row's
prompt asks for yes or no, the answer is one constrained token, and it scores 1 when it is the row's answer."""

ACTIONS = ["yes", "no"]


def render_prompt(observation) -> str:
    return observation["prompt"]


def parse_action(text: str, observation=None) -> dict | None:
    return {"answer": text.strip()} if text.strip() in ACTIONS else None


def reward(prompt_row: dict, answer: str) -> float:
    return 1.0 if answer == prompt_row["answer"] else 0.0
