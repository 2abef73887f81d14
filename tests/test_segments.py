"""The chat-agent record (forge_rl/rollout/segments.py) with a tokenizer whose eos is not its chat template's
end of turn: a base Qwen model's, eos <|endoftext|> under a ChatML template that closes turns with <|im_end|>
(the tiny model's tokenizer, told so)."""

from transformers import AutoTokenizer

from forge_rl.core.config import ChatConfig
from forge_rl.core.types import Completion
from forge_rl.models.tiny import build_tiny_model
from forge_rl.rollout.chat_server import ChatServer
from forge_rl.rollout.segments import Renderer, commit, normalize_message, plan_request
from tests.chat_helpers import SYSTEM, TURNS, chatml_user


def test_the_end_of_turn_comes_from_the_template_not_the_eos(tmp_path):
    """Two replies, one closed by the policy with <|im_end|>, one cut off at max_tokens: the third prompt is
    the first prompt, each reply as sampled (the second closed with <|im_end|>), and each following turn's
    text as the template renders it, tokenized alone: no <|endoftext|> anywhere, the newline after each
    <|im_end|> kept. And the server stops replies at <|im_end|>, which is not among the eos ids."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny", seed=0), eos_token="<|endoftext|>")
    assert tokenizer.eos_token == "<|endoftext|>" and "<|im_end|>" in tokenizer.chat_template
    renderer, im_end = Renderer(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    replies = [("HIT", ids("HIT") + [im_end]), ("STAND", ids("STAND"))]
    segments, messages, prompts = [], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}], []
    for turn, (text, sampled) in enumerate(replies + [(None, None)]):
        normalized = [normalize_message(m) for m in messages]
        plan = plan_request(renderer, segments[-1] if segments else None, normalized, None)
        prompts.append(plan.token_ids if plan.new_segment else segments[-1].token_ids + plan.token_ids)
        if text is None:
            break
        completion = Completion(prompts[-1], sampled, [-1.0] * len(sampled), text, "stop", policy_version=turn)
        commit(segments, plan, completion, normalized, normalize_message({"role": "assistant", "content": text}))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": TURNS[turn + 1]}]

    first = ids(tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True))
    expected = first + replies[0][1] + ids(chatml_user(TURNS[1])) + replies[1][1] + [im_end] + ids(chatml_user(TURNS[2]))
    assert len(segments) == 1 and prompts[-1] == expected
    assert tokenizer.eos_token_id not in prompts[-1] and (renderer.end_text, renderer.end_id) == ("<|im_end|>", im_end)
    server = ChatServer(tokenizer, None, {"temperature": 1.0}, {"temperature": 0.0}, ChatConfig(), 256)
    assert server.sampling["stop_token_ids"] == server.greedy["stop_token_ids"] == [im_end]
