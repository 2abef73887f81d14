"""The whole GRPO loop of the embedded default vs a plain in-process loop doing the same work, in one run.

Baseline (written for this bench, in this process, nothing around it): the same tiny Qwen3 (HF
transformers, same seed), the same batch (batch_size deals x group_size games), OpenSpiel BlackJack
in-process (apps/blackjack/env.py's environment class, no server), every live game's next
decision in one HF `generate` call per turn (lockstep, left-padded, constrained to the same answer
ids, the same temperature), the same prompts and EpisodeRecord bookkeeping, then the same GRPO loss
(forge_rl/core/loss.py, entropy bonus and all, over the same renormalised logits) and one AdamW step with
the same learning rate and gradient clipping.
Measured: forge_rl's own loop, `start` + `train` (forge_rl/recipes/grpo/) on the config (synchronous: generate a
batch, then train), for the same number of steps after the same warm-up.

Prints `loop_vs_inprocess episodes_per_s ours=<x> baseline=<y> ratio=<x/y>` (whole steps) and
`train_step_vs_inprocess ...` (the train step alone: the baseline's loss + backward + AdamW, ours
`time/train_step_s`, the Trainer actor's call). Figures only, no asserts. The two policies learn
from the same start, so they play about as many turns per game.

    python bench/loop.py [--config configs/blackjack_tiny_cpu.yaml] [--steps 8] [--warmup 2] [key=value ...]
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apps.blackjack import task as blackjack  # noqa: E402
from apps.blackjack.env import BlackJackAction, BlackJackEnvironment  # noqa: E402
from forge_rl.core.app import load_app  # noqa: E402
from forge_rl.core.config import load_config  # noqa: E402
from forge_rl.core.episode import EpisodeRecord  # noqa: E402
from forge_rl.core.estimators import estimate  # noqa: E402
from forge_rl.core.loss import grpo_loss  # noqa: E402
from forge_rl.core.types import Completion  # noqa: E402
from forge_rl.engines.titan.model import pad_right, position_logprobs, sampling_logits  # noqa: E402
from forge_rl.envs.local import env_url  # noqa: E402
from forge_rl.models import resolve_model  # noqa: E402
from forge_rl.recipes.grpo.loop import train  # noqa: E402
from forge_rl.recipes.grpo.main import shutdown, start  # noqa: E402
from forge_rl.recipes.metrics import read_metrics  # noqa: E402
from forge_rl.rollout.play import answer_token_ids, prompt_ids  # noqa: E402


class InProcessLoop:
    """The honest minimum: one process, HF generate over all live games per turn, OpenSpiel in-process."""

    def __init__(self, cfg, model_dir: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.allowed = answer_token_ids(load_app("apps.blackjack.task"), self.tokenizer)
        o = cfg.trainer.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay, foreach=True)
        self.next_seed = 0

    def restrict(self, input_ids, scores):  # a transformers LogitsProcessor: only the answer ids
        return sampling_logits(scores, self.allowed)

    @torch.no_grad()
    def play(self) -> list:
        """batch_size deals x group_size games, every live game's next answer in one generate call."""
        cfg, tok = self.cfg, self.tokenizer
        seeds = [s for s in range(self.next_seed, self.next_seed + cfg.grpo.batch_size) for _ in range(cfg.grpo.group_size)]
        self.next_seed += cfg.grpo.batch_size
        envs = [BlackJackEnvironment() for _ in seeds]
        obs = [e.reset(seed=s).model_dump() for e, s in zip(envs, seeds)]
        convs = [EpisodeRecord(prompt_ids(blackjack, tok, o, True)) for o in obs]
        self.model.eval()
        for turn in range(cfg.rollout.max_turns):
            live = [i for i, o in enumerate(obs) if not o["done"]]
            if not live:
                break
            if turn:
                for i in live:
                    convs[i].add_prompt(prompt_ids(blackjack, tok, obs[i], False, close_previous=True))
            length = max(len(convs[i].token_ids) for i in live)
            ids = torch.tensor([[tok.pad_token_id] * (length - len(convs[i].token_ids)) + convs[i].token_ids for i in live])
            out = self.model.generate(
                input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), max_new_tokens=1, do_sample=True,
                temperature=cfg.sampling.temperature, top_p=1.0, top_k=0, logits_processor=[self.restrict],
                output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
            )
            answers = out.sequences[:, -1]
            logprobs = torch.log_softmax(out.scores[0].float(), -1).gather(-1, answers[:, None])[:, 0]
            for i, a, lp in zip(live, answers.tolist(), logprobs.tolist()):
                text = tok.decode([a])
                convs[i].add_completion(Completion(convs[i].token_ids, [a], [lp], text, "length", 0))
                obs[i] = envs[i].step(BlackJackAction(**blackjack.parse_action(text, obs[i]))).model_dump()
        return [c.to_episode(blackjack.reward(o, False, 0.0), f"s{s}") for c, o, s in zip(convs, obs, seeds)]

    def train_step(self, batch: list) -> None:
        """The same GRPO loss over the whole batch in one forward/backward, then AdamW."""
        cfg = self.cfg
        self.model.train()
        length = max(len(e.tokens) for e in batch)
        tokens = pad_right([e.tokens for e in batch], length)
        mask = pad_right([e.loss_mask.float() for e in batch], length)[:, 1:]
        behaviour = pad_right([e.behaviour_logprobs for e in batch], length)[:, 1:]
        advantages = pad_right(estimate(batch, cfg.grpo), length)[:, 1:]  # [B, T - 1] per token
        logits = self.model(tokens[:, :-1]).logits
        lp, entropy = position_logprobs(logits, tokens[:, 1:], self.allowed, cfg.sampling.temperature)
        loss, _ = grpo_loss(lp, behaviour, advantages, mask, cfg.grpo, entropy=entropy, denominator=mask.sum().item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.trainer.optimizer.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()


class OurLoop:
    """forge_rl's loop as `make train` runs it: `start`, then `train`, one step per call."""

    def __init__(self, cfg):
        self.cfg, self.job, self.server = cfg, None, None

    async def start(self) -> None:
        from tqdm import tqdm

        url, self.server = env_url(self.cfg.env.url, self.cfg.env.server, self.cfg.env.max_concurrent)
        self.job, self.progress = await start(self.cfg, load_app(self.cfg.app_module), url), tqdm(disable=True)

    async def step(self) -> int:
        """One train step of the loop (play a batch, train, push and load the weights): episodes played."""
        played = self.job.rollouts.episodes_played
        self.cfg.trainer.max_steps = self.job.state.step + 1  # the Trainer's LR schedule was built for the whole bench
        await train(self.job, self.progress, [])
        return self.job.rollouts.episodes_played - played

    async def stop(self) -> None:
        await shutdown(self.job)
        if self.server is not None:
            self.server.stop()


async def measure(cfg, model_dir: str, warmup: int, steps: int, with_baseline: bool) -> dict:
    """Baseline and forge_rl steps alternate, so that both see the same load on a shared machine.
    Returns episodes/s of each (whole steps, and the train step alone), summed over the timed steps."""
    baseline, ours = InProcessLoop(cfg, model_dir), OurLoop(cfg)
    totals = dict.fromkeys(["base_s", "base_train_s", "base_episodes", "ours_s", "ours_episodes"], 0.0)
    await ours.start()
    try:
        for i in range(warmup + steps):
            timed = i >= warmup
            if with_baseline:
                start = time.perf_counter()
                batch = await asyncio.to_thread(baseline.play)  # a thread: the actors' sockets stay served
                played = time.perf_counter()
                await asyncio.to_thread(baseline.train_step, batch)
                if timed:
                    totals["base_s"] += time.perf_counter() - start
                    totals["base_train_s"] += time.perf_counter() - played
                    totals["base_episodes"] += len(batch)
            start = time.perf_counter()
            episodes = await ours.step()
            if timed:
                totals["ours_s"] += time.perf_counter() - start
                totals["ours_episodes"] += episodes
        ours.job.metrics.close()
        rows = [r for r in read_metrics(Path(cfg.run_dir)) if r["step"] > warmup]
    finally:
        await ours.stop()
    for key in ("time/train_step_s", "time/push_weights_s", "time/update_weights_s"):
        print(f"ours {key}: median {statistics.median(r[key] for r in rows):.3f} s")
    per_step = cfg.grpo.batch_size * cfg.grpo.group_size
    print(f"ours whole step {totals['ours_s'] / steps:.3f} s; baseline {totals['base_s'] / steps:.3f} s, "
          f"its train step {totals['base_train_s'] / steps:.3f} s")
    nan = float("nan")
    return {
        "ours_loop": totals["ours_episodes"] / totals["ours_s"],
        "base_loop": totals["base_episodes"] / totals["base_s"] if with_baseline else nan,
        "ours_train": per_step / statistics.mean(r["time/train_step_s"] for r in rows),
        "base_train": per_step * steps / totals["base_train_s"] if with_baseline else nan,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/blackjack_tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-baseline", action="store_true", help="only forge_rl's loop (profiling)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, as for python -m forge_rl.grpo")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        fixed = [f"run_dir={tmp}/run", "eval.interval=0", "trainer.checkpoint_every=0", "logging.tensorboard=false"]
        cfg = load_config(args.config, args.overrides + fixed + [f"trainer.max_steps={args.warmup + args.steps}"])
        model_dir = resolve_model(cfg.model.path, cfg.model.dtype, Path(cfg.run_dir) / "tiny_model", cfg.model.tiny_seed)
        print(f"load before: {os.getloadavg()}; batch {cfg.grpo.batch_size} deals x {cfg.grpo.group_size} games")
        r = asyncio.run(measure(cfg, model_dir, args.warmup, args.steps, not args.skip_baseline))
        print(f"load after: {os.getloadavg()}")
    print(f"loop_vs_inprocess episodes_per_s ours={r['ours_loop']:.1f} baseline={r['base_loop']:.1f} ratio={r['ours_loop'] / r['base_loop']:.3f}")
    print(f"train_step_vs_inprocess episodes_per_s ours={r['ours_train']:.1f} baseline={r['base_train']:.1f} "
          f"ratio={r['ours_train'] / r['base_train']:.3f}")


if __name__ == "__main__":
    main()
