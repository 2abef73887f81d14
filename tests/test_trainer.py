"""Trainer and ReferenceModel as real Monarch actors on the tiny Qwen3 (CPU, fp32, gloo).

The actors are module-scoped (spawning costs seconds) and shared by the tests, which must not rely on one
another's order (xdist's worksteal may run any of them first, or alone): what must be seen before any update
is taken when the actors start, a test that needs untrained twins starts its own, and a test that needs
trained weights trains them itself. The last tests run a Trainer and a ReferenceModel in this process (no
Monarch) to check the batch layout and the train step alone.
"""

import asyncio
import math

import pytest
import torch
from monarch.actor import ActorError

from forge_rl.weights import control
from forge_rl.runtime.actor import stop
from forge_rl.core.config import GRPOConfig, OptimizerConfig
from forge_rl.core.estimators import estimate
from forge_rl.core.objective import GRPOLoss
from forge_rl.engines.titan.reference import ReferenceModel
from forge_rl.models.tiny import build_tiny_model
from forge_rl.engines.titan.trainer import Trainer
from forge_rl.core.types import Episode
from tests.steps import actor_data, data_of, plain_data, train_step

GRPO = GRPOConfig(kl_coef=0.05, entropy_coef=0.0, estimator="grpo")


def data(batch: list[Episode]) -> dict:
    """What the learner fixes for a batch of the GRPO objective the shared trainers train with."""
    return plain_data(GRPOLoss(GRPO), batch)
OPTIM = OptimizerConfig(lr=1e-3, schedule="constant")


def make_batch(n_groups=3, group_size=3, seed=0) -> list[Episode]:
    """Multi-turn-shaped episodes: prompt (6 ids), a sampled answer, an environment reply
    (not trained), a second sampled answer; lengths differ so padding is exercised."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for group in range(n_groups):
        for k in range(group_size):
            length = 14 + k
            tokens = torch.randint(5, 150, (length,), generator=g)
            mask = torch.zeros(length)
            mask[6:9] = 1  # first answer
            mask[11:] = 1  # second answer, after a 2-token environment reply
            behaviour = torch.where(mask.bool(), -2 - 3 * torch.rand(length, generator=g), torch.zeros(length))
            batch.append(Episode(tokens, mask, behaviour, float((group + k) % 2), 0, f"group{group}"))
    return batch


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


async def start_trainers(model_dir):
    """A 1-rank and a 2-rank (FSDP2) trainer on the same weights."""
    return await asyncio.gather(
        Trainer.options(procs=1).as_actor(model_dir, GRPOLoss(GRPO), OPTIM, micro_batch_size=2),
        Trainer.options(procs=2).as_actor(model_dir, GRPOLoss(GRPO), OPTIM, micro_batch_size=2),
    )


@pytest.fixture(scope="module")
def started(loop, model_dir):
    """The shared actors, and their log-probs of make_batch() taken before any test can train them."""
    from types import SimpleNamespace

    async def start():
        (one, two), ref, _ = await asyncio.gather(
            start_trainers(model_dir),
            ReferenceModel.options(num_replicas=1).as_service(model_dir, micro_batch_size=2),
            control.start(),
        )
        ids = [e.tokens for e in make_batch()]
        before = await ref.route("logprobs", ids), await one.logprobs.call_one(ids), ranks(await two.logprobs.call(ids))
        return SimpleNamespace(one=one, two=two, ref=ref, before=before)

    actors = loop.run_until_complete(start())
    yield actors

    async def finish():
        await asyncio.gather(stop(actors.one), stop(actors.two), actors.ref.stop(), control.stop())

    loop.run_until_complete(finish())


@pytest.fixture(scope="module")
def actors(started):
    return started.one, started.two, started.ref


@pytest.fixture
def twins(loop, model_dir):
    """Untrained 1-rank and 2-rank trainers of the test's own."""
    one, two = loop.run_until_complete(start_trainers(model_dir))
    yield one, two

    async def finish():
        await asyncio.gather(stop(one), stop(two))

    loop.run_until_complete(finish())


def ranks(value_mesh) -> list:
    return [v for _, v in value_mesh.items()]


def assert_lists_close(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


def hf_logprobs(model_dir, token_ids, state_dict=None, temperature=1.0):
    """Independent check: Hugging Face transformers' Qwen3 on the same ids (log softmax(logits / temperature))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)  # tied models have no lm_head.weight
    out = []
    with torch.no_grad():
        for ids in token_ids:
            logits = model(ids[None]).logits[0, :-1] / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), lp]))
    return out


def test_reference_equals_trainer_and_hf_before_any_update(started, model_dir):
    ids = [e.tokens for e in make_batch()]
    ref_lp, one_lp, (two_lp0, two_lp1) = started.before
    assert_lists_close(one_lp, ref_lp, atol=0)  # same model code, same weights
    assert_lists_close(two_lp0, one_lp, atol=1e-5)  # FSDP2 over 2 ranks
    assert_lists_close(two_lp1, two_lp0, atol=0)
    assert_lists_close(one_lp, hf_logprobs(model_dir, ids), atol=1e-5)  # HF weights came in right


def test_train_step_finite_and_two_ranks_match_one(loop, actors, twins):
    (one, two), (_, _, ref) = twins, actors
    batch = make_batch()

    async def main():
        ref_lp = await ref.route("logprobs", [e.tokens for e in batch])
        steps = []
        for _ in range(2):
            steps.append((await one.train_step.call_one(batch, data(batch), ref_lp), ranks(await two.train_step.call(batch, data(batch), ref_lp))))
        return steps

    (m1, (m2, m2b)), (n1, (n2, _)) = loop.run_until_complete(main())
    expected = {"loss", "kl", "entropy", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean"}
    expected |= {"ratio_min", "ratio_max", "grad_norm", "lr", "step", "num_tokens"}
    assert expected <= set(m1)
    assert all(math.isfinite(v) for v in m1.values()), m1
    assert m1["step"] == 1 and m1["num_tokens"] == sum(int(e.loss_mask.sum()) for e in batch)
    assert m1["ratio_max"] != m1["ratio_min"]  # ratio taken against behaviour log-probs, not 1
    assert m2 == m2b  # every rank reports the same numbers
    for key in ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "entropy", "clip_fraction"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # After one update the runs differ only by float noise (Adam magnifies it on ~0 gradients).
    for key in ("loss", "kl", "grad_norm", "ratio_mean"):
        assert n2[key] == pytest.approx(n1[key], rel=1e-3), key
    assert n1["kl"] > 0


def test_kl_without_reference_logprobs_is_refused(loop, actors):
    one, _, _ = actors
    with pytest.raises(ActorError, match="ref_logprobs"):
        batch = make_batch()
        loop.run_until_complete(one.train_step.call_one(batch, data(batch)))


def test_loss_decreases_on_a_repeated_batch(loop, actors):
    one, _, ref = actors
    batch = make_batch(seed=1)

    async def main():
        ref_lp = await ref.route("logprobs", [e.tokens for e in batch])
        return [(await one.train_step.call_one(batch, data(batch), ref_lp))["loss"] for _ in range(6)]

    losses = loop.run_until_complete(main())
    assert losses[-1] < losses[0] - 0.05, losses


def test_checkpoint_resume_gives_identical_numbers(loop, actors, tmp_path):
    one, two, ref = actors
    batch = make_batch(seed=2)

    async def main():
        ref_lp = await ref.route("logprobs", [e.tokens for e in batch])
        for _ in range(2):
            await one.train_step.call_one(batch, data(batch), ref_lp)
        await one.save_checkpoint.call_one(str(tmp_path / "ckpt"))
        after_save = await one.train_step.call_one(batch, data(batch), ref_lp)
        progress = await one.load_checkpoint.call_one(str(tmp_path / "ckpt"))
        resumed = await one.train_step.call_one(batch, data(batch), ref_lp)
        # The same checkpoint resharded onto the 2-rank trainer.
        await two.load_checkpoint.call(str(tmp_path / "ckpt"))
        resharded = ranks(await two.train_step.call(batch, data(batch), ref_lp))[0]
        return after_save, progress, resumed, resharded

    after_save, progress, resumed, resharded = loop.run_until_complete(main())
    assert resumed == after_save
    assert progress["step"] == after_save["step"] - 1
    for key in ("loss", "kl", "grad_norm", "lr", "step"):
        assert resharded[key] == pytest.approx(after_save[key], rel=1e-4), key


def test_push_weights_puts_hf_weights_in_the_store(loop, actors, model_dir):
    _, two, _ = actors
    ids = [e.tokens for e in make_batch(seed=3)]
    train(loop, two)  # here, not by an earlier test: xdist's worksteal may run this test first on a fresh trainer

    async def main():
        sizes = ranks(await two.push_weights.call(7))
        pushed = await control.get_state_dict(7)
        return sizes, pushed, ranks(await two.logprobs.call(ids))[0]

    sizes, pushed, trainer_lp = loop.run_until_complete(main())
    from safetensors.torch import load_file

    original = load_file(f"{model_dir}/model.safetensors")
    assert sizes == [sum(v.numel() * v.element_size() for v in original.values())] * 2  # the bytes published
    assert set(pushed) == set(original)
    assert not torch.equal(pushed["lm_head.weight"], original["lm_head.weight"])  # trained weights, not the file
    assert_lists_close(hf_logprobs(model_dir, ids, pushed), trainer_lp, atol=1e-5)


@pytest.fixture(scope="module")
def pushers(loop, model_dir, actors):
    """Trainers pushing by each transport: 3 ranks through shared memory (FSDP2's shards uneven: 1108 rows
    are 370 + 370 + 368), 2 ranks and 1 rank by broadcast (to this process, once `broadcast_group` made it
    their group's rank 1), and 2 ranks by broadcast whose group only the test of a failing push forms."""
    from types import SimpleNamespace

    def trainer(procs, weight_sync):
        return Trainer.options(procs=procs).as_actor(model_dir, GRPOLoss(GRPO), OPTIM, micro_batch_size=2, weight_sync=weight_sync)

    async def start():
        return await asyncio.gather(trainer(3, "shm"), trainer(2, "broadcast"), trainer(1, "broadcast"), trainer(2, "broadcast"))

    shm, broadcast, unsharded, never_joined = loop.run_until_complete(start())
    yield SimpleNamespace(shm=shm, broadcast=broadcast, unsharded=unsharded, never_joined=never_joined, groups={})

    async def finish():
        await asyncio.gather(stop(shm), stop(broadcast), stop(unsharded), stop(never_joined))

    loop.run_until_complete(finish())


def broadcast_group(loop, pushers, name: str):
    """This process as rank 1 of trainer `name`'s broadcast group (formed on first use)."""
    from forge_rl.core.net import free_port
    from forge_rl.weights.broadcast import join_group

    async def join(trainer, port):
        _, group = await asyncio.gather(trainer.join_weights_group.call("127.0.0.1", port, 2, "127.0.0.1"),
                                        asyncio.to_thread(join_group, "127.0.0.1", port, 1, 2, "127.0.0.1", 120))
        return group

    if name not in pushers.groups:
        pushers.groups[name] = loop.run_until_complete(join(getattr(pushers, name), free_port()))
    return pushers.groups[name]


async def within(awaitable, seconds):
    return await asyncio.wait_for(awaitable, seconds)


def received(handle: dict, group) -> dict[str, torch.Tensor]:
    """What a generator's vLLM worker on this host would load from `handle`, copied."""
    from forge_rl.weights.layout import WeightsHandle, tensor_views
    from forge_rl.weights.broadcast import broadcast_receive
    from forge_rl.weights.shm import shared_views

    handle = WeightsHandle(**handle)
    if handle.kind == "shm":
        return {k: v.clone() for k, v in shared_views(handle)}
    return {k: v.clone() for k, v in tensor_views(broadcast_receive(group, handle, None), handle.layout)}


def push(loop, trainer, version, group=None) -> dict[str, torch.Tensor]:
    """Push `version` from every rank of `trainer`; what a generator then loads."""
    sizes = ranks(loop.run_until_complete(within(trainer.push_weights.call(version), 120)))
    assert len(set(sizes)) == 1 and sizes[0] > 0  # every rank took part
    return received(loop.run_until_complete(control.get_handle(version)), group)


def train(loop, trainer):
    batch = make_batch(seed=5)
    loop.run_until_complete(trainer.train_step.call(batch, data(batch), [torch.zeros(len(e.tokens)) for e in batch]))


def assert_equal_to_checkpoint(model_dir, pushed):
    from safetensors.torch import load_file

    original = load_file(f"{model_dir}/model.safetensors")
    assert set(pushed) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(pushed[name], tensor, atol=0, rtol=0)


def assert_trained_weights(loop, trainer, model_dir, pushed):
    from safetensors.torch import load_file

    ids = [e.tokens for e in make_batch(seed=4)]
    assert not torch.equal(pushed["lm_head.weight"], load_file(f"{model_dir}/model.safetensors")["lm_head.weight"])
    assert_lists_close(hf_logprobs(model_dir, ids, pushed), ranks(loop.run_until_complete(trainer.logprobs.call(ids)))[0], atol=1e-5)


def test_a_push_failing_on_rank_0_leaves_the_ranks_in_step(loop, pushers):
    """Rank 0 refuses (no broadcast group yet) while rank 1 gathers with it: the push fails with the reason,
    no rank is left waiting in a gather, and the next push works."""
    with pytest.raises(ActorError, match="join_weights_group was never called"):
        loop.run_until_complete(within(pushers.never_joined.push_weights.call(30), 120))
    push(loop, pushers.never_joined, 30, broadcast_group(loop, pushers, "never_joined"))


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_sharded_trainers_push_bit_exact(loop, pushers, model_dir, transport):
    """FSDP over 3 ranks through shared memory, each rank copying its own rows of each tensor into the buffer;
    over 2 ranks by broadcast, each tensor gathered (full_tensor) as its turn comes: bit-exact to the
    checkpoint before training, the trained weights after."""
    trainer = getattr(pushers, transport)
    group = broadcast_group(loop, pushers, transport) if transport == "broadcast" else None
    assert_equal_to_checkpoint(model_dir, push(loop, trainer, 21, group))
    train(loop, trainer)
    assert_trained_weights(loop, trainer, model_dir, push(loop, trainer, 22, group))


def test_an_unsharded_trainer_steps_only_once_its_broadcast_is_sent(loop, pushers, model_dir):
    """One rank: the broadcast sends the parameters themselves after push returns, so the next optimizer step
    waits for the generators to take it; they get exactly the pushed version."""
    trainer, group = pushers.unsharded, broadcast_group(loop, pushers, "unsharded")
    loop.run_until_complete(trainer.push_weights.call(41))
    handle = loop.run_until_complete(control.get_handle(41))
    batch = make_batch(seed=5)

    async def step_while_sending():
        step = asyncio.ensure_future(within(trainer.train_step.call(batch, data(batch), [torch.zeros(len(e.tokens)) for e in batch]), 120))
        await asyncio.sleep(5)  # a step of the tiny model takes well under a second
        waited = not step.done()
        pushed = await asyncio.to_thread(received, handle, group)
        await step
        return waited, pushed

    waited, pushed = loop.run_until_complete(step_while_sending())
    assert waited
    assert_equal_to_checkpoint(model_dir, pushed)
    assert_trained_weights(loop, trainer, model_dir, push(loop, trainer, 42, group))


# ---- In this process, no actors: the batch layout and one train step alone.


def in_process(actor_cls, *args, **kwargs):
    """An actor object with its setup() run here (a process group of one, no Monarch)."""
    actor = actor_cls(*args, **kwargs)
    asyncio.run(actor_cls.setup._method(actor))
    return actor


def test_advantages_are_computed_per_group():
    """Group a's rewards are all above group b's: one baseline for the whole batch would make every
    advantage of a positive and of b negative, where GRPO compares games of the same deal."""
    batch = [e for e in make_batch(n_groups=2, group_size=2)]
    for e, reward in zip(batch, [2.0, 3.0, -3.0, -2.0]):
        e.reward = reward
    batch = [batch[0], batch[2], batch[1], batch[3]]  # groups interleaved: rows are matched by group_id
    advantages = torch.tensor([float(a[0]) for a in estimate(batch, GRPOConfig(estimator="grpo"))])
    torch.testing.assert_close(advantages, torch.tensor([-1.0, -1.0, 1.0, 1.0]), atol=1e-5, rtol=0)
    advantages = torch.tensor([float(a[0]) for a in estimate(batch, GRPOConfig(estimator="dr_grpo", loss_agg="token_mean"))])
    torch.testing.assert_close(advantages, torch.tensor([-0.5, -0.5, 0.5, 0.5]), atol=1e-5, rtol=0)


def test_batch_tensors_keep_each_token_at_its_position():
    batch = make_batch(n_groups=1, group_size=3)
    t = Trainer("unused")._tensors(batch, [e.behaviour_logprobs + 1 for e in batch])
    for i, e in enumerate(batch):
        n = len(e.tokens)
        assert t["lengths"][i] == n and torch.equal(t["tokens"][i, :n], e.tokens) and not t["tokens"][i, n:].any()
        assert torch.equal(t["mask"][i, :n], e.loss_mask) and not t["mask"][i, n:].any()
        assert torch.equal(t["behaviour"][i, :n], e.behaviour_logprobs)
        assert torch.equal(t["ref"][i, :n], e.behaviour_logprobs + 1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_on_policy_train_step_has_ratio_one_at_the_sampling_temperature(model_dir, temperature):
    """Behaviour log-probs as the generator returns them (of logits / temperature, from an independent
    model) at the trained positions: the first step's ratio is 1 on every token. A trainer that scores
    at temperature 1, or reads its log-probs one position off the mask, does not get 1."""
    batch = make_batch()
    for e, lp in zip(batch, hf_logprobs(model_dir, [e.tokens for e in batch], temperature=temperature)):
        e.behaviour_logprobs = lp * e.loss_mask
    trainer = in_process(Trainer, model_dir, GRPOLoss(GRPOConfig(loss_agg="token_mean")), OPTIM, micro_batch_size=2, temperature=temperature)
    metrics = train_step(trainer, batch, None)
    assert metrics["ratio_min"] == pytest.approx(1, abs=1e-4) and metrics["ratio_max"] == pytest.approx(1, abs=1e-4)
    assert metrics["num_tokens"] == sum(int(e.loss_mask.sum()) for e in batch)

    reference = in_process(ReferenceModel, model_dir, micro_batch_size=2, temperature=temperature)
    ref_lp = asyncio.run(ReferenceModel.logprobs._method(reference, [e.tokens for e in batch]))
    assert_lists_close([lp * e.loss_mask for lp, e in zip(ref_lp, batch)], [e.behaviour_logprobs for e in batch], 1e-4)


def test_resume_with_more_steps_continues_the_new_schedule(model_dir, tmp_path):
    """A cosine schedule decays to lr 0 at max_steps; resumed with a larger max_steps, the next step
    trains at the new schedule's lr, not at the 0 the checkpoint holds."""
    batch, cosine = make_batch(), OptimizerConfig(lr=1e-3, schedule="cosine")
    first = in_process(Trainer, model_dir, GRPOLoss(GRPOConfig(loss_agg="token_mean")), cosine, max_steps=2)
    lrs = [train_step(first, batch, None)["lr"] for _ in range(2)]
    asyncio.run(Trainer.save_checkpoint._method(first, str(tmp_path / "ckpt")))
    assert lrs[0] == 1e-3 and first.optimizers.optimizers[0].param_groups[0]["lr"] == 0

    longer = in_process(Trainer, model_dir, GRPOLoss(GRPOConfig(loss_agg="token_mean")), cosine, max_steps=4)
    asyncio.run(Trainer.load_checkpoint._method(longer, str(tmp_path / "ckpt")))
    resumed = train_step(longer, batch, None)
    assert resumed["step"] == 3 and resumed["lr"] == pytest.approx(0.5e-3), "cosine over 4 steps is at half at step 2"


def test_the_entropy_floor_is_decided_once_for_the_whole_batch(model_dir):
    """With entropy_floor between the batch's mean entropy and that of its most uncertain episode, the bonus
    is on for the step: every micro-batch gets it, also those whose own entropy is above the floor. Equal
    rewards (zero advantages) leave the bonus alone in the loss: -coef x the batch's mean entropy, the same
    in one piece or in one piece per episode."""
    from forge_rl.engines.titan.model import sequence_logprobs

    batch = make_batch()
    for e in batch:
        e.reward = 1.0
    probe = in_process(Trainer, model_dir, GRPOLoss(GRPOConfig(loss_agg="token_mean")), OPTIM)
    per_episode, weights = [], []
    with torch.no_grad():
        for e in batch:
            _, entropy = sequence_logprobs(probe.model, e.tokens[None], entropy=True)
            mask = e.loss_mask[1:].float()
            per_episode.append(float((entropy[0] * mask).sum() / mask.sum()))
            weights.append(float(mask.sum()))
    mean = sum(h * w for h, w in zip(per_episode, weights)) / sum(weights)
    assert mean < max(per_episode), per_episode
    floor = (mean + max(per_episode)) / 2  # the batch is below it; some episodes are not
    config = GRPOConfig(entropy_coef=1.0, entropy_floor=floor, estimator="dr_grpo", loss_agg="token_mean")
    for micro_batch_size in (len(batch), 1):
        trainer = in_process(Trainer, model_dir, GRPOLoss(config), OPTIM, micro_batch_size=micro_batch_size)
        metrics = train_step(trainer, batch, None)
        assert metrics["loss"] == pytest.approx(-mean, rel=1e-4), (micro_batch_size, metrics["loss"], -mean)
    above = GRPOConfig(entropy_coef=1.0, entropy_floor=min(per_episode) / 2, estimator="dr_grpo", loss_agg="token_mean")  # off for every piece
    trainer = in_process(Trainer, model_dir, GRPOLoss(above), OPTIM, micro_batch_size=1)
    assert train_step(trainer, batch, None)["loss"] == pytest.approx(0.0, abs=1e-6)


PPO = GRPOConfig(estimator="ppo", value_coef=1.0)


def test_ppo_trains_its_value_head_in_the_policys_step(model_dir):
    """estimator ppo on the real trainer: a value head (zero at the start) whose loss, measured before each update
    on a fixed batch, falls; the step's advantages are the return minus the step-start values (lambda = 1)."""
    batch = make_batch()
    trainer = in_process(Trainer, model_dir, GRPOLoss(PPO), OPTIM, micro_batch_size=2)
    first = train_step(trainer, batch, None)
    assert first["value_mean"] == 0.0 and all(math.isfinite(v) for v in first.values()), first
    fits = [first["value_loss"]] + [train_step(trainer, batch, None)["value_loss"] for _ in range(5)]
    assert fits[-1] < 0.5 * fits[0], fits
    # the advantages of a batch: each turn's reward minus the value the head gives its state before its updates
    data, _ = data_of(trainer, batch)
    for i, e in enumerate(batch):
        for start in (6, 11):  # each answer's first token: its advantage is reward - V there, over the whole answer
            assert data["advantages"][i, start] == pytest.approx(e.reward - float(data["values"][i, start]), abs=1e-6)
            assert data["returns"][i, start] == pytest.approx(e.reward, abs=1e-6) and data["value_mask"][i, start] == 1
        assert torch.equal(data["advantages"][i, 6:9], data["advantages"][i, 6:7].expand(3))
    assert data["value_mask"].sum() == 2 * len(batch)


def test_ppo_resume_restores_the_value_head(model_dir, tmp_path):
    """The head and its AdamW state are in the checkpoint: a resumed trainer's next step is the same numbers
    (a head restarted from zero gives other advantages and another value loss). The HF export leaves it out."""
    batch = make_batch(seed=4)
    first = in_process(Trainer, model_dir, GRPOLoss(PPO), OPTIM, micro_batch_size=2)
    for _ in range(2):
        train_step(first, batch, None)
    asyncio.run(Trainer.save_checkpoint._method(first, str(tmp_path / "ckpt")))
    expected = train_step(first, batch, None)
    resumed = in_process(Trainer, model_dir, GRPOLoss(PPO), OPTIM, micro_batch_size=2)
    asyncio.run(Trainer.load_checkpoint._method(resumed, str(tmp_path / "ckpt")))
    again = train_step(resumed, batch, None)
    assert again["value_mean"] != 0.0
    for key in ("loss", "value_loss", "value_mean", "grad_norm"):
        assert again[key] == expected[key], key

    from safetensors import safe_open

    asyncio.run(Trainer.export_hf._method(resumed, str(tmp_path / "hf")))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as exported:
        assert not [k for k in exported.keys() if "value" in k]


def test_ppo_on_two_ranks_matches_one(loop, model_dir):
    """FSDP2 over 2 ranks shards the head with the root; each rank scores its own rows' values and the no-grad
    pass sums them, so both ranks fix the same advantages: the same value loss and loss as one rank, twice."""

    async def main():
        one, two = await asyncio.gather(
            Trainer.options(procs=1).as_actor(model_dir, GRPOLoss(PPO), OPTIM, micro_batch_size=2),
            Trainer.options(procs=2).as_actor(model_dir, GRPOLoss(PPO), OPTIM, micro_batch_size=2),
        )
        try:
            batch, steps = make_batch(seed=5), []
            for _ in range(2):
                (d1, f1), (d2, f2) = await actor_data(one, GRPOLoss(PPO), batch), await actor_data(two, GRPOLoss(PPO), batch)
                steps.append(({**await one.train_step.call_one(batch, d1), **f1}, [{**m, **f2} for m in ranks(await two.train_step.call(batch, d2))]))
            return steps
        finally:
            await asyncio.gather(stop(one), stop(two))

    for m1, (m2, m2b) in loop.run_until_complete(main()):
        assert m2 == m2b
        for key in ("loss", "value_loss", "value_mean", "value_explained_variance", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key


def test_a_non_finite_step_is_skipped_and_three_in_a_row_stop(model_dir):
    """A NaN advantage makes the loss NaN: the step leaves every weight (and AdamW's state) as it was and counts
    itself skipped; a finite step then trains as usual; three non-finite steps in a row stop with one line."""
    trainer = in_process(Trainer, model_dir, GRPOLoss(GRPOConfig(loss_agg="token_mean")), OPTIM, micro_batch_size=2)
    batch = make_batch()
    data, _ = data_of(trainer, batch)
    poisoned = {**data, "advantages": data["advantages"].clone()}
    poisoned["advantages"][0, 6] = float("nan")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = asyncio.run(Trainer.train_step._method(trainer, batch, poisoned, None))
    assert metrics["skipped_steps"] == 1 and not math.isfinite(metrics["loss"])
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert not trainer.optimizers.optimizers[0].state, "AdamW took no step"
    assert train_step(trainer, batch)["skipped_steps"] == 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    asyncio.run(Trainer.train_step._method(trainer, batch, poisoned, None))
    asyncio.run(Trainer.train_step._method(trainer, batch, poisoned, None))
    with pytest.raises(FloatingPointError, match=r"optimizer steps 3-5 had a non-finite loss nan .* the weights untouched"):
        asyncio.run(Trainer.train_step._method(trainer, batch, poisoned, None))
