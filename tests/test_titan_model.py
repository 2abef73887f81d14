"""titan_model: HF directory -> TorchTitan model, in this process (no actors)."""

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from forge_rl.core.net import free_port
from forge_rl.models.tiny import build_tiny_model
from forge_rl.engines.titan.hf_weights import hf_weight_rows, hf_weights
from forge_rl.engines.titan.model import build_model, logprobs_of
from tests.test_trainer import hf_logprobs


def tied_model(path):
    """The tiny model with tied input/output embeddings, like Qwen3 0.6B-4B (no lm_head.weight)."""
    path = build_tiny_model(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(path / "model.safetensors"))
    weights.pop("lm_head.weight")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def hf_state_dict(model, adapter) -> dict:
    shapes, tensors = hf_weights(model, adapter)
    return dict(zip(shapes, tensors, strict=True))


def test_tied_embeddings_survive_fsdp_and_round_trip(tmp_path):
    path = tied_model(tmp_path / "tied")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model, adapter = build_model(path, torch.device("cpu"), shard=True)  # FSDP2 even on one rank
        ids = [torch.randint(5, 150, (12,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        for ours, theirs in zip(logprobs_of(model, ids, torch.device("cpu"), "float32"), hf_logprobs(str(path), ids)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        out = hf_state_dict(model, adapter)
        original = load_file(str(path / "model.safetensors"))
        assert set(out) == set(original)  # to_hf leaves the tied head out again
        for name, tensor in original.items():
            torch.testing.assert_close(out[name], tensor, atol=0, rtol=0)
    finally:
        dist.destroy_process_group()


def test_sharded_weights_are_gathered_one_tensor_at_a_time_in_the_sync_dtype(tmp_path, monkeypatch):
    """What push_weights copies from: each parameter gathered (full_tensor) only when its turn comes, never
    a whole second model at once, cast before the gather; bit-exact to the checkpoint cast alike."""
    from torch.distributed.tensor import DTensor

    path = build_tiny_model(tmp_path / "m")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model, adapter = build_model(path, torch.device("cpu"), shard=True)
        gathered, full_tensor = [], DTensor.full_tensor
        monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: gathered.append(self.dtype) or full_tensor(self, **kw))
        shapes, tensors = hf_weights(model, adapter, "bfloat16")
        assert gathered == [] and {(t.device.type, t.dtype) for t in shapes.values()} == {("meta", torch.bfloat16)}
        out = {}
        for name, tensor in zip(shapes, tensors, strict=True):
            out[name] = tensor
            assert len(gathered) == len(out)  # one gather per tensor taken, as it is taken
        assert set(gathered) == {torch.bfloat16}
        original = load_file(str(path / "model.safetensors"))
        assert set(out) == set(original)
        for name, tensor in original.items():
            assert out[name].shape == shapes[name].shape
            torch.testing.assert_close(out[name], tensor.to(torch.bfloat16), atol=0, rtol=0)
    finally:
        dist.destroy_process_group()


def test_rows_of_a_sharded_model_need_no_gather_for_tensors_hf_only_renames(tmp_path, monkeypatch):
    """hf_weight_rows (all trainer ranks writing into one shared buffer): Qwen3's tensors are only renamed
    for HF, so each rank gives its own rows of each (one rank here: all of them) and nothing is gathered."""
    from torch.distributed.tensor import DTensor

    path = build_tiny_model(tmp_path / "m")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model, adapter = build_model(path, torch.device("cpu"), shard=True)
        gathered, full_tensor = [], DTensor.full_tensor
        monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: gathered.append(1) or full_tensor(self, **kw))
        shapes, rows = hf_weight_rows(model, adapter, "bfloat16")
        original = load_file(str(path / "model.safetensors"))
        for name, (first, tensor) in zip(shapes, rows, strict=True):
            assert first == 0 and not isinstance(tensor, DTensor)
            torch.testing.assert_close(tensor, original[name].to(torch.bfloat16), atol=0, rtol=0)
        assert gathered == [] and set(shapes) == set(original)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_unsharded_hf_state_dict_is_the_parameters_themselves_bit_exact(tmp_path, tied):
    """One rank, no FSDP: the HF state dict is the model's own parameters (what push_weights copies from)."""
    path = tied_model(tmp_path / "m") if tied else build_tiny_model(tmp_path / "m")
    model, adapter = build_model(path, torch.device("cpu"))
    out = hf_state_dict(model, adapter)
    original = load_file(str(path / "model.safetensors"))
    assert set(out) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(out[name], tensor, atol=0, rtol=0)
    parameters = {p.data_ptr() for p in model.parameters()}
    assert all(t.data_ptr() in parameters for t in out.values())


def test_unknown_model_family_names_the_fix(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="MODEL_FAMILIES"):
        build_model(path, torch.device("cpu"))


def qwen2_model(path):
    """A small random Qwen2 (Qwen2.5's family: q/k/v biases, no q/k norms), every weight and bias drawn."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(path)
    return path


def test_qwen2_is_the_trainers_model_as_transformers_computes_it_lora_and_export_included(tmp_path):
    """Qwen2.5's family, the second real one: TorchTitan's Qwen3 without q/k norms and with q/k/v biases gives
    transformers' log-probs, with LoRA layers too (their base layers keep the biases), and to_hf gives back
    every tensor of the checkpoint, biases included (weight sync and export)."""
    from forge_rl.core.config import LoraConfig

    path = qwen2_model(tmp_path / "qwen2")
    ids = [torch.randint(5, 150, (12,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expected = hf_logprobs(str(path), ids)
    for lora in (None, LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])):
        model, adapter = build_model(path, torch.device("cpu"), lora=lora)
        for ours, theirs in zip(logprobs_of(model, ids, torch.device("cpu"), "float32"), expected):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    model, adapter = build_model(path, torch.device("cpu"))
    out, original = hf_state_dict(model, adapter), load_file(str(path / "model.safetensors"))
    assert set(out) == set(original) and "model.layers.1.self_attn.k_proj.bias" in out
    for name, tensor in original.items():
        torch.testing.assert_close(out[name], tensor, atol=0, rtol=0)
