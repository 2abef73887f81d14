"""The policy as a TorchTitan model: built from a Hugging Face directory, HF weights in and out.

Trainer and ReferenceModel build from the directory the generator loads, so all three start identical.
A model family is one line in MODEL_FAMILIES (and one `*_args` function if its config keys differ).
Batch layout: right-padded token ids; position t of every [B, T] tensor is about token t.
"""

import dataclasses
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtitan.models.llama3 import Transformer as Llama3Model
from torchtitan.models.llama3 import TransformerModelArgs as Llama3ModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from forge_rl.engines.titan import value_head as value_heads
from forge_rl.engines.titan.lora import apply_lora, initial_state, lora_layers, with_base_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def qwen3_args(hf: dict) -> Qwen3ModelArgs:
    """HF Qwen3 config.json -> TorchTitan args (sdpa attention: runs on CPU and GPU alike)."""
    if hf.get("rope_scaling"):
        raise NotImplementedError(f"rope_scaling {hf['rope_scaling']} is not mapped to TorchTitan's Qwen3; use a model without it")
    return Qwen3ModelArgs(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"],
        head_dim=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=rope_theta(hf),
        qk_norm=True,
        max_seq_len=hf["max_position_embeddings"],
        enable_weight_tying=hf.get("tie_word_embeddings", False),
        attn_type="sdpa",
    )


def qwen2_args(hf: dict) -> Qwen3ModelArgs:
    """Qwen2 (Qwen2.5) is Qwen3 without q/k norms and with q/k/v biases, which Qwen2Model adds."""
    return dataclasses.replace(qwen3_args(hf), qk_norm=False)


class Qwen2Model(Qwen3Model):
    def __init__(self, model_args: Qwen3ModelArgs):
        super().__init__(model_args)
        for block in self.layers.values():
            for name in ("wq", "wk", "wv"):
                linear = getattr(block.attention, name)
                setattr(block.attention, name, torch.nn.Linear(linear.in_features, linear.out_features, bias=True))


class Qwen2StateDictAdapter(Qwen3StateDictAdapter):
    def __init__(self, model_args, hf_assets_path):
        super().__init__(model_args, hf_assets_path)
        self.from_hf_map |= {f"model.layers.{{}}.self_attn.{hf}_proj.bias": f"layers.{{}}.attention.w{hf}.bias" for hf in "qkv"}


def llama_args(hf: dict) -> Llama3ModelArgs:
    """HF Llama config.json -> TorchTitan's Llama 3 args (SmolLM2, Llama 3.x).

    TorchTitan always applies Llama 3.1's rope scaling; factor 1 makes it plain rope. Its feed-forward width
    is derived: multiple_of = intermediate_size and a multiplier a hair under the ratio give exactly that width.
    """
    if hf.get("tie_word_embeddings", False):
        raise NotImplementedError(
            "TorchTitan's Llama cannot tie embeddings: give the model an lm_head.weight and tie_word_embeddings false "
            "(forge_rl/models/ does that for GGUF models)"
        )
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise NotImplementedError(f"head_dim {head_dim} x {hf['num_attention_heads']} heads != hidden_size: not TorchTitan's Llama")
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if scaling.get("rope_type", "default") == "llama3":
        rope_scaling = RoPEScalingArgs(
            scaling_factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        )
    elif scaling.get("rope_type", "default") == "default":
        rope_scaling = RoPEScalingArgs(scaling_factor=1.0)
    else:
        raise NotImplementedError(f"rope {scaling} is not mapped to TorchTitan's Llama")
    base = int(2 * 4 * hf["hidden_size"] / 3)  # TorchTitan's FeedForward width before the multiplier
    return Llama3ModelArgs(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"],
        multiple_of=hf["intermediate_size"],
        ffn_dim_multiplier=(hf["intermediate_size"] - 0.5) / base,
        norm_eps=hf["rms_norm_eps"],
        rope_theta=rope_theta(hf),
        rope_scaling_args=rope_scaling,
        max_seq_len=hf["max_position_embeddings"],
        attn_type="sdpa",
    )


def rope_theta(hf: dict) -> float:
    """transformers 5 writes rope_theta inside rope_parameters; older configs at the top level."""
    return hf["rope_theta"] if "rope_theta" in hf else hf["rope_parameters"]["rope_theta"]


# HF `model_type` -> (config.json -> model args, TorchTitan model class, HF <-> TorchTitan adapter).
MODEL_FAMILIES = {
    "qwen3": (qwen3_args, Qwen3Model, Qwen3StateDictAdapter),
    "llama": (llama_args, Llama3Model, Llama3StateDictAdapter),
    "qwen2": (qwen2_args, Qwen2Model, Qwen2StateDictAdapter),
}


# ---------------------------------------------------------------------------- process set-up


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from the env the provisioner set; without MASTER_ADDR, alone."""
    use_gpu = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world, device_id=device if use_gpu else None)
    return rank, world, device


# ---------------------------------------------------------------------------- the model


def build_model(
    hf_dir: str | Path, device: torch.device, dtype: str = "float32", shard: bool | None = None, lora=None, value_head: bool = False
):
    """TorchTitan model holding the HF checkpoint's weights; returns (model, adapter).

    The value head goes on after LoRA, which freezes every other parameter. Sharded over more than one rank
    unless `shard` says otherwise. Parameters stay fp32 (the optimizer's master copy); `dtype` is the compute
    dtype: FSDP's mixed precision when sharded, autocast otherwise.
    """
    hf_dir = Path(hf_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    family = hf_config.get("model_type")
    if family not in MODEL_FAMILIES:
        raise ValueError(f"{hf_dir}: model_type {family!r} not supported; add it to MODEL_FAMILIES ({sorted(MODEL_FAMILIES)})")
    make_args, model_cls, adapter_cls = MODEL_FAMILIES[family]
    args = make_args(hf_config)
    adapter = adapter_cls(args, str(hf_dir))
    with torch.device("meta"):
        model = model_cls(args)
    if lora is not None:
        apply_lora(model, adapter, lora)
    if value_head:
        value_heads.attach(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if shard if shard is not None else world > 1:
        shard_model(model, init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",)), dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # recomputes the rope cache; weights overwritten below
    load_hf_weights(model, adapter, hf_dir)
    return model, adapter


def shard_model(model: torch.nn.Module, mesh, dtype: str) -> None:
    """FSDP2 the way TorchTitan wraps a decoder: each block, then the root.

    Not TorchTitan's apply_fsdp: its separate groups for embeddings and output head fail when they are tied
    (Qwen3 0.6B-4B). Gradients are summed, not averaged: the loss is normalised by the global batch.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if mesh.device_type == "cpu":  # gloo has no PREMUL_SUM, which FSDP uses for that factor
                module.set_force_sum_reduction_for_comms(True)


def load_hf_weights(model: torch.nn.Module, adapter, hf_dir: Path) -> None:
    """Every rank reads the full HF checkpoint; set_model_state_dict keeps each rank's shard."""
    hf_state = {k: v for file in sorted(Path(hf_dir).glob("*.safetensors")) for k, v in load_file(str(file)).items()}
    if not hf_state:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors weights found")
    state = {k: v.float() for k, v in adapter.from_hf(hf_state).items()} | value_heads.initial_state(model)
    if lora_layers(model):
        state = with_base_names(state, model) | initial_state(model)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def autocast(device: torch.device, dtype: str):
    """Compute in `dtype` over fp32 parameters when FSDP's mixed precision is not doing it."""
    return torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "float32")


# ---------------------------------------------------------------------------- batches


def pad_right(rows: list[torch.Tensor], length: int, value=0) -> torch.Tensor:
    """[T_i] tensors -> [B, length], right-padded (causal attention never looks right)."""
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def sampling_logits(logits: torch.Tensor, allowed_token_ids: list[int] | None, temperature: float = 1.0) -> torch.Tensor:
    """The logits of the distribution the generator samples from (it returns processed log-probs).

    Top-p/top-k truncation is not mirrored, so the config refuses it (SamplingConfig.check)."""
    if allowed_token_ids is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[list(allowed_token_ids)] = True
        logits = logits.masked_fill(~keep, -1e9)  # finite, so that 0 * log 0 terms of the entropy stay 0
    return logits if temperature == 1.0 else logits / temperature


@contextmanager
def scoring_head(model: torch.nn.Module, index: torch.Tensor):
    """Within it, `model(tokens)` returns logits [len(index), V] at flat positions `index` of its [B * T] outputs.

    A hook on the head's input, so the module tree, and FSDP's parameter names, stay as they are."""
    handle = model.output.register_forward_pre_hook(lambda module, args: (args[0].flatten(0, 1)[index],))
    try:
        yield
    finally:
        handle.remove()


def scored_logprobs(
    logits: torch.Tensor, which: torch.Tensor, targets: torch.Tensor, allowed_token_ids: list[int] | None = None,
    temperature: float = 1.0, entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one computation of log-probs under the sampling distribution: token i is `targets[i]`, predicted by
    row `which[i]` of `logits` [U, V]. Returns ([N], entropy [N] or None).

    Constrained, the softmax covers the allowed ids only, so it costs A, not V, per row; a target outside them
    (a prompt position, never trained) gets what masking the whole vocabulary would give it."""
    outside = None
    if allowed_token_ids is not None:
        allowed = torch.as_tensor(list(allowed_token_ids), device=logits.device)
        column = torch.full((int(allowed.max()) + 1,), -1, dtype=torch.long, device=logits.device)
        column[allowed] = torch.arange(len(allowed), device=logits.device)
        logits = logits.index_select(-1, allowed)
        targets = torch.where(targets < len(column), column[targets.clamp(max=len(column) - 1)], -1)
        outside = targets < 0
    logp = torch.log_softmax(sampling_logits(logits, None, temperature).float(), dim=-1)  # [U, K]
    lp = logp[which, targets.clamp(min=0)]
    if outside is not None and outside.any():
        lse = torch.logsumexp(sampling_logits(logits, None, temperature).float(), dim=-1)[which]
        lp = torch.where(outside, -1e9 / temperature - lse, lp)
    return lp, (-(logp.exp() * logp).sum(-1)[which] if entropy else None)


def position_logprobs(logits: torch.Tensor, targets: torch.Tensor, allowed_token_ids=None, temperature: float = 1.0,
                      entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`scored_logprobs` at every position: logits [B, T, V], targets [B, T] -> ([B, T], [B, T] or None)."""
    b, t = targets.shape
    flat = torch.arange(b * t, device=logits.device)
    lp, h = scored_logprobs(logits.flatten(0, 1), flat, targets.flatten(), allowed_token_ids, temperature, entropy)
    return lp.view(b, t), (h.view(b, t) if h is not None else None)


def sequence_logprobs(model: torch.nn.Module, tokens: torch.Tensor, allowed_token_ids=None, temperature: float = 1.0,
                      entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [B, T] -> log-probs [B, T] (position 0: 0, as Episode.behaviour_logprobs), entropy [B, T - 1]."""
    lp, h = position_logprobs(model(tokens[:, :-1]), tokens[:, 1:], allowed_token_ids, temperature, entropy)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1), h


@torch.no_grad()
def logprobs_of(
    model, token_ids: list[torch.Tensor], device, dtype: str, micro_batch_size: int = 8, allowed_token_ids=None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per-token log-probs [T_i] (fp32, CPU) of each 1-D id tensor, in micro-batches."""
    out = []
    for start in range(0, len(token_ids), micro_batch_size):
        rows = token_ids[start : start + micro_batch_size]
        tokens = pad_right([torch.as_tensor(r) for r in rows], max(len(r) for r in rows)).to(device)
        with autocast(device, dtype):
            lp, _ = sequence_logprobs(model, tokens, allowed_token_ids, temperature)
        out.extend(lp[i, : len(r)].float().cpu() for i, r in enumerate(rows))
    return out
