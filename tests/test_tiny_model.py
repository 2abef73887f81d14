"""The tiny model: same seed gives the same bytes, and its tokenizer speaks BlackJack in whole words."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from forge_rl.models.tiny import build_tiny_model

BLACKJACK_PROMPT = (
    "You are playing BlackJack. Your cards: 10 and A (total 21, soft). The dealer shows K; "
    "the dealer's other card is hidden. Answer with one word: HIT or STAND."
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_same_seed_gives_identical_files_and_another_seed_other_weights(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (model_dir / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (model_dir / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_config_is_a_small_qwen3_that_vllm_cpu_accepts(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim >= 32  # vllm-cpu refuses 16
    assert config.num_attention_heads * config.head_dim == config.hidden_size
    weights = load_file(model_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)
    assert weights["lm_head.weight"].shape == (config.vocab_size, config.hidden_size)
    assert len(AutoTokenizer.from_pretrained(model_dir)) == config.vocab_size


def test_tokenizer_loads_renders_the_chat_template_and_round_trips_blackjack_text(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Play well."}, {"role": "user", "content": BLACKJACK_PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\nPlay well.<|im_end|>\n<|im_start|>user\n{BLACKJACK_PROMPT}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text  # decoding is concatenation: what structured outputs relies on
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert tokenizer.convert_ids_to_tokens(eos) == "<|im_end|>" == tokenizer.eos_token


def test_vocabulary_covers_blackjack_words_each_as_one_token(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = "HIT STAND you have cards total soft hard dealer shows ace J Q K A answer with one word".split()
    words += [str(n) for n in range(32)]
    for word in words:
        for form in (word, " " + word):
            ids = tokenizer(form, add_special_tokens=False)["input_ids"]
            assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, form
    for punctuation in ".,:;!?()'\"-":
        assert tokenizer(punctuation, add_special_tokens=False)["input_ids"] != [tokenizer.unk_token_id]
    assert tokenizer("xyzzy", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_constrained_answers_outside_the_vocabulary_are_refused(model_dir):
    """An app's answer the tiny model does not know is one token, [UNK], and would pass a one-token
    check: every answer would then be invalid, silently. It is refused with the answer named."""
    from forge_rl.core.app import App
    from forge_rl.core.config import ConfigError
    from forge_rl.rollout.play import answer_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(ConfigError, match=r"answer 'FOLD' of apps\.poker is not in the model's vocabulary"):
        answer_token_ids(App("apps.poker", answers=("HIT", "FOLD")), tokenizer)
    assert answer_token_ids(App("apps.poker", answers=("HIT", "STAND")), tokenizer) == tokenizer.convert_tokens_to_ids(["HIT", "STAND"])
