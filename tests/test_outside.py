"""apps/blackjack/outside.py: an exported policy played outside the project, with plain transformers, the app's
render_prompt and the model's chat template, on OpenSpiel's own dealing."""

from safetensors.torch import load_file, save_file

from apps.blackjack.outside import play
from forge_rl.models.tiny import build_tiny_model


def test_a_policy_whose_every_logit_is_zero_answers_hit_and_busts_every_hand(tmp_path):
    # lm_head (tied or not) zeroed: every logit is 0, the tie goes to the first of the app's ACTIONS, "HIT", and a
    # player who always hits loses every hand: exactly -1. A wrong action mapping would stand (about -0.18)
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    weights = load_file(model_dir / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head] = weights[head] * 0
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    ev, invalid = play(str(model_dir), "apps.blackjack.task", games=40, seed=3)
    assert (ev, invalid) == (-1.0, 0.0)
