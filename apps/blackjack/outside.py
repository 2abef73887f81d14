"""A trained policy outside the project: an exported HF directory (run_dir/final/hf) played greedily with plain
transformers on OpenSpiel's own dealing (its chance outcomes, drawn at random), prompted by the app's
render_prompt through the model's chat template, each turn rendered from the whole conversation as any user of
the exported model would. Its EV should be the run's last evaluation's, within the noise of the deals.

    python -m apps.blackjack.outside runs/blackjack_smollm2_cpu/final/hf --app apps.blackjack.natural --games 2000
"""

from __future__ import annotations

import argparse
import importlib
import math
import random

import pyspiel
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from apps.blackjack.rules import ACTIONS as OPENSPIEL_ACTIONS, hand


def play(model_dir: str, app_name: str, games: int, seed: int = 0, template_kwargs: dict | None = None) -> tuple[float, float]:
    """(EV, invalid rate) of greedy play on `games` hands. The answer is the most likely of the app's ACTIONS
    (each one token) where the app has them, else a greedy free answer of up to 12 tokens."""
    app = importlib.import_module(app_name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    actions = getattr(app, "ACTIONS", None)
    action_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in actions or ()]
    constrained = bool(actions) and all(len(ids) == 1 for ids in action_ids)
    game, rng, total, invalid = pyspiel.load_game("blackjack"), random.Random(seed), 0.0, 0
    for _ in range(games):
        state = game.new_initial_state()
        messages = [{"role": "system", "content": app.SYSTEM_PROMPT}] if getattr(app, "SYSTEM_PROMPT", None) else []
        while not state.is_terminal():
            if state.is_chance_node():
                outcomes, probs = zip(*state.chance_outcomes())
                state.apply_action(rng.choices(outcomes, probs)[0])
                continue
            obs = {**hand(state), "done": False}
            messages.append({"role": "user", "content": app.render_prompt(obs)})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                                **(template_kwargs or {}))["input_ids"]
            with torch.no_grad():
                if constrained:
                    logits = model(ids, logits_to_keep=1).logits[0, -1]  # the head at the last position only
                    answer = actions[int(torch.stack([logits[i[0]] for i in action_ids]).argmax())]
                else:
                    out = model.generate(ids, max_new_tokens=12, do_sample=False)
                    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            action = app.parse_action(answer, obs)
            if action is None:
                invalid += 1
                break
            messages.append({"role": "assistant", "content": answer})
            state.apply_action(OPENSPIEL_ACTIONS[action["action"]])
        total += state.returns()[0] if state.is_terminal() else -1.0  # an invalid answer: the app's penalty of 1
    return total / games, invalid / games


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--app", default="apps.blackjack.natural")
    parser.add_argument("--games", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-thinking", action="store_true", help="enable_thinking=false for the chat template (Qwen3)")
    args = parser.parse_args()
    ev, invalid = play(args.model_dir, args.app, args.games, args.seed, {"enable_thinking": False} if args.no_thinking else None)
    half_width = 1.96 * 0.95 / math.sqrt(args.games)  # a hand's return has a standard deviation of about 0.95
    print(f"outside EV {ev:+.3f} (+-{half_width:.3f} at 95%) over {args.games} hands of OpenSpiel's dealing; invalid {invalid:.3f}")


if __name__ == "__main__":
    main()
