"""The second real model, Qwen2.5-Coder-0.5B-Instruct (qwen2), from its six PyPI pieces (apps/models/qwen25_coder.py):
what its HF directory keeps of the GGUF file, and its chat template with tools rendered alike by vLLM, the environment
form (rollout/play.py, whose ids the trainer trains on) and the chat server (segments.py). Skipped without the pieces
(`make fetch-qwen25`); forward consistency with TorchTitan's qwen2 is tests/test_smollm2.py's, on both models."""

import dataclasses
import json
import os

import pytest
import torch

from apps.models import qwen25_coder

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
if not qwen25_coder.installed():
    pytest.skip("Qwen2.5-Coder-0.5B-Instruct's packages are not installed (make fetch-qwen25)", allow_module_level=True)

MODEL = "package:apps.models.qwen25_coder"
TOOLS = [{"name": name, "description": description, "inputSchema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}
         for name, description in [("run_python", "Run a Python program."), ("submit", "Submit the final program.")]]  # fmt: skip


@pytest.fixture(scope="module")
def path():
    from forge_rl.models import resolve_model

    return resolve_model(MODEL)


def test_the_hf_directory_keeps_the_files_output_head_and_template(path):
    """The GGUF file's own output head (Q8_0) is lm_head, not a copy of its Q5_0 embedding; the chat template is the
    file's, character for character; a turn ends with <|im_end|>, which is also the eos."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from forge_rl.rollout.segments import end_of_turn

    config = json.loads(open(f"{path}/config.json").read())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 24 and not config["tie_word_embeddings"]
    reader = gguf.GGUFReader(qwen25_coder.gguf_file())
    head = next(t for t in reader.tensors if t.name == "output.weight")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        lm_head, embedding = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(lm_head, torch.from_numpy(gguf.dequantize(head.data, head.tensor_type).copy()))
    assert not torch.equal(lm_head, embedding)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template == reader.get_field("tokenizer.chat_template").contents()
    assert end_of_turn(tokenizer) == ("<|im_end|>", tokenizer.eos_token_id)


def test_vllm_the_environment_form_and_the_chat_server_render_a_conversation_with_tools_alike(path):
    """A run_python call, its result, the next prompt: vLLM's own chat rendering (LLM.chat, as `vllm serve` renders a
    request) gives the ids the environment form builds turn by turn (each turn tokenized alone and appended to the
    sampled answer) and the chat server's renderer. Qwen's template puts the tools and the app's system prompt in one
    system message, and a tool's result in a user turn inside <tool_response>."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from apps.coder import tools_task
    from forge_rl.core.app import load_app
    from forge_rl.engines.vllm.cpu import cpu_environment
    from forge_rl.rollout.play import prompt_ids
    from forge_rl.rollout.segments import Renderer
    from forge_rl.rollout.tools import function_specs

    tokenizer = AutoTokenizer.from_pretrained(path)
    app = dataclasses.replace(load_app("apps.coder.tools_task"), tools=function_specs(TOOLS))
    task = {"statement": "Write a Python function `double(x)` that returns 2 * x.", "entry_point": "double", "max_turns": 3}
    answer = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    result = {"tool_name": "run_python", "result": "exit code 0\nstdout:\n42\n\nstderr:\n", "done": False}
    ours = (prompt_ids(app, tokenizer, task, True) + tokenizer(answer, add_special_tokens=False)["input_ids"]
            + [tokenizer.eos_token_id] + prompt_ids(app, tokenizer, result, False))  # fmt: skip
    messages = [{"role": "system", "content": tools_task.SYSTEM_PROMPT}, {"role": "user", "content": tools_task.render_prompt(task)},
                {"role": "assistant", "content": answer}, {"role": "tool", "content": "exit code 0\nstdout:\n42\n\nstderr:\n"}]  # fmt: skip
    text = Renderer(tokenizer).render(messages, list(app.tools), True)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours
    assert "<tools>" in text and "<tool_response>\nexit code 0" in text and tools_task.SYSTEM_PROMPT in text

    os.environ.update(cpu_environment(1))
    llm = LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 28, seed=0, enable_chunked_prefill=False)
    try:
        (out,) = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0), tools=list(app.tools), add_generation_prompt=True)
        assert list(out.prompt_token_ids) == ours
    finally:
        del llm
