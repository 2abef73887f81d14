"""The RL engine end to end with real actors: generator service (vLLM), trainer (TorchTitan), reference
service, replay buffer actor and TorchStore, on the tiny model and a synthetic verifiable task.

The task: a prompt shows a number and asks for HIT or STAND; the reward is 1 for STAND (a verifiable
rule every prompt agrees on, so a few steps must move the policy whatever the random init). Sampling is
restricted to the two answer tokens (as the BlackJack app's constrained decoding), and the trainer and
reference renormalise over the same tokens. Checked on the way:
- the reward rises over a few GRPO steps;
- every completion carries the version of the weights that sampled it, and only the latest version
  stays in TorchStore;
- token identity: the ids the trainer consumes are exactly prompt + sampled ids;
- forward consistency: at every version, the trainer's log-probs of sampled tokens equal the
  generator's behaviour log-probs (constrained and unconstrained), and before any update the
  reference's equal both.
"""

import asyncio
import random

import torch

from forge_rl.weights import control
from forge_rl.runtime.actor import stop
from forge_rl.core.config import GeneratorConfig, GRPOConfig, OptimizerConfig, SamplingConfig
from forge_rl.core.objective import GRPOLoss
from tests.steps import plain_data
from forge_rl.engines.vllm.generator import Generator
from forge_rl.engines.titan.reference import ReferenceModel
from forge_rl.buffer.replay_buffer import ReplayBufferActor
from forge_rl.core.episode import EpisodeRecord
from forge_rl.models.tiny import build_tiny_model
from forge_rl.rollout.play import sampling_params
from forge_rl.engines.titan.trainer import Trainer

NUMBERS = [4, 5, 6, 7, 8, 9, 10, 11, 17, 18, 19, 20, 21]
GROUP_SIZE, GROUPS_PER_STEP, STEPS = 8, len(NUMBERS), 6  # every number once per step
FORWARD_TOLERANCE = 1e-4  # fp32 on CPU; measured differences are ~1e-6


def prompt_for(tokenizer, n: int) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Your total is {n}. Answer with one word: HIT or STAND."}],
        tokenize=False, add_generation_prompt=True,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def expected_reward(trainer, tokenizer, hit, stand) -> float:
    """The policy's expected reward over all numbers, exactly: mean of p(STAND | number)."""
    rows = [torch.tensor(prompt_for(tokenizer, n) + [stand]) for n in NUMBERS]
    lp = (await trainer.logprobs.call(rows)).item(procs=0)
    return sum(row[-1].exp().item() for row in lp) / len(NUMBERS)


def consistency(trainer_lp: list[torch.Tensor], episodes) -> float:
    """Max |trainer - behaviour| log-prob over every sampled token of `episodes`."""
    worst = 0.0
    for lp, e in zip(trainer_lp, episodes):
        diff = (lp - e.behaviour_logprobs)[e.loss_mask.bool()].abs()
        worst = max(worst, diff.max().item())
    return worst


def test_grpo_steps_raise_reward_with_versioned_weights_and_invariants(tmp_path):
    async def main():
        from transformers import AutoTokenizer

        model = str(build_tiny_model(tmp_path / "tiny", seed=0))
        tokenizer = AutoTokenizer.from_pretrained(model)
        hit, stand = (tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("HIT", "STAND"))
        allowed = [hit, stand]
        grpo = GRPOConfig(group_size=GROUP_SIZE, batch_size=GROUPS_PER_STEP, max_policy_age=0, kl_coef=0.01,
                          entropy_coef=0.0, estimator="grpo")

        await control.start()
        policy, trainer, reference, buffer, unrestricted = await asyncio.gather(
            Generator.options(num_replicas=1).as_service(model, "float32", GeneratorConfig(max_model_len=256)),
            Trainer.options(procs=1).as_actor(model, GRPOLoss(grpo), OptimizerConfig(lr=3e-4, schedule="constant"), STEPS, "float32",
                                              allowed_token_ids=allowed),
            ReferenceModel.options(num_replicas=1).as_service(model, "float32", micro_batch_size=8, allowed_token_ids=allowed),
            ReplayBufferActor.options().as_actor(GROUPS_PER_STEP, 0),
            Trainer.options(procs=1).as_actor(model, GRPOLoss(grpo), OptimizerConfig(), STEPS, "float32"),
        )
        rng = random.Random(0)
        sampling = {"temperature": 1.0, "max_tokens": 1, "allowed_token_ids": allowed}
        try:
            # Unconstrained sampling at temperature 1: a trainer scoring the full vocabulary agrees with
            # the generator's behaviour log-probs of free text, also of answers a stop string ended (inside
            # their last token, which is kept whole: sampling.stop as the rollouts send it).
            free = await policy.route("generate", prompt_for(tokenizer, 9), {"temperature": 1.0, "max_tokens": 6, "n": 4})
            free += await policy.route("generate", prompt_for(tokenizer, 9), {**sampling_params(SamplingConfig(stop=["e"], max_tokens=12), None), "n": 6, "seed": 5})
            assert sum("e" in c.text for c in free[4:]) >= 3
            free_episodes = []
            for c in free:
                conversation = EpisodeRecord(c.prompt_ids)
                conversation.add_completion(c)
                free_episodes.append(conversation.to_episode(0.0, "free"))
            free_lp = (await unrestricted.logprobs.call([e.tokens for e in free_episodes])).item(procs=0)
            free_diff = consistency(free_lp, free_episodes)
            assert free_diff < FORWARD_TOLERANCE, f"unconstrained: trainer and generator differ by {free_diff}"
            await stop(unrestricted)

            reward_before = await expected_reward(trainer, tokenizer, hit, stand)
            rewards_per_step, max_forward_diff = [], 0.0
            for version in range(STEPS):
                numbers = rng.sample(NUMBERS, len(NUMBERS))
                step_rewards = []
                for g, n in enumerate(numbers):
                    prompt = prompt_for(tokenizer, n)
                    completions = await policy.route("generate", prompt, {**sampling, "n": GROUP_SIZE})
                    group = []
                    for c in completions:
                        assert c.policy_version == version, "a completion must carry the version that sampled it"
                        assert c.prompt_ids == prompt and c.token_ids[0] in allowed
                        conversation = EpisodeRecord(prompt)
                        conversation.add_completion(c)
                        episode = conversation.to_episode(float(c.token_ids[0] == stand), f"v{version}g{g}")
                        # token identity: what the trainer will consume is the prompt plus the sampled ids
                        assert episode.tokens.tolist() == prompt + c.token_ids
                        group.append(episode)
                        step_rewards.append(episode.reward)
                    await buffer.add.call_one(group)
                rewards_per_step.append(sum(step_rewards) / len(step_rewards))

                batch = await buffer.sample.call_one(version)
                assert batch is not None and len(batch) == GROUP_SIZE * GROUPS_PER_STEP
                trainer_lp = (await trainer.logprobs.call([e.tokens for e in batch])).item(procs=0)
                max_forward_diff = max(max_forward_diff, consistency(trainer_lp, batch))
                ref_lp = await reference.route("logprobs", [e.tokens for e in batch])
                if version == 0:
                    assert consistency(ref_lp, batch) < FORWARD_TOLERANCE, "reference != generator at v0"
                metrics = (await trainer.train_step.call(batch, plain_data(GRPOLoss(grpo), batch, version), ref_lp)).item(procs=0)
                assert abs(metrics["ratio_max"] - 1) < 1e-3, "on-policy data must have importance ratio 1"
                await trainer.push_weights.call(version + 1)
                await policy.fanout("update_weights", version + 1)
                await control.delete_version(version)
                assert await control.list_versions() == [version + 1]
                assert await policy.route("current_version") == version + 1

            reward_after = await expected_reward(trainer, tokenizer, hit, stand)
            print(f"expected reward {reward_before:.3f} -> {reward_after:.3f}; sampled reward per step: "
                  f"{[round(r, 2) for r in rewards_per_step]}; max |trainer - generator| log-prob: "
                  f"{max_forward_diff:.2e} constrained, {free_diff:.2e} free text")
            assert max_forward_diff < FORWARD_TOLERANCE
            assert reward_after > reward_before + 0.3, f"reward did not rise: {reward_before} -> {reward_after}"
            assert rewards_per_step[-1] > rewards_per_step[0], f"sampled reward did not rise: {rewards_per_step}"
            assert metrics["kl"] > 0, "after updates the policy must differ from the reference"

        finally:
            await policy.stop()
            await reference.stop()
            await stop(trainer)
            await stop(buffer)
            await control.stop()

    asyncio.run(main())
