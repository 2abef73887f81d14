"""Per-answer centring (`grpo.centre_per_answer`): a CHANGE OF OBJECTIVE, not variance reduction.

Each trained token's advantage minus the batch's mean advantage of the same token id. In logit terms a state
then moves by how much better an answer is THERE than it is on average over the batch. Its expected update
is the policy gradient of a different reward, r(s, a) - b(a), with b re-estimated every batch: with one
state it is zero whatever the policy; with several, a state where the generally better answer wins by less
than its average margin is pushed toward the WORSE answer (tests/test_estimators.py shows it on a bandit).
Defined only for one-token answers from a fixed set (`sampling.constrained`); off by default, and no result
of the project's rests on it.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def centre_per_answer(per_token: list[torch.Tensor], tokens: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per token [T] advantages, ids [T] and trained masks [T] of each episode -> the centred advantages."""
    trained = [[(p, int(ids[p])) for p in torch.nonzero(torch.as_tensor(m)).flatten().tolist()] for ids, m in zip(tokens, masks)]
    sums, counts = defaultdict(float), defaultdict(int)
    for positions, a in zip(trained, per_token):
        for p, token in positions:
            sums[token] += float(a[p])
            counts[token] += 1
    out = []
    for positions, a in zip(trained, per_token):
        a = a.clone()
        for p, token in positions:
            a[p] -= sums[token] / counts[token]
        out.append(a)
    return out
