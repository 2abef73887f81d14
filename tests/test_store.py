"""TorchStore through forge_rl.store: bit-exact round trips across processes, versions, deletion."""

import asyncio

import pytest
import torch

from forge_rl.weights import control
from forge_rl.runtime.actor import stop
from tests.service_actors import StoreReader


def make_state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g, dtype=torch.float32),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.rand(32, generator=g, dtype=torch.float32) + 0.5,
        "lm_head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    }


def test_state_dict_round_trips_bit_exact_across_processes_and_versions_are_deleted():
    async def main():
        await control.start()
        reader = await StoreReader.options(procs=1).as_actor()
        try:
            sd1, sd2 = make_state_dict(1), make_state_dict(2)
            await control.put_state_dict(sd1, version=1)
            await control.put_state_dict(sd2, version=2)
            assert await control.list_versions() == [1, 2]

            fetched = await reader.fetch.call_one(2)
            assert set(fetched) == set(sd2)
            for name, tensor in sd2.items():
                assert fetched[name].dtype == tensor.dtype, name
                assert fetched[name].shape == tensor.shape, name
                # bit-exact: compare raw bytes, so bf16 rounding or NaN quirks can't hide a difference
                assert torch.equal(fetched[name].view(torch.uint8) if tensor.dtype != torch.bfloat16
                                   else fetched[name].view(torch.int16),
                                   tensor.view(torch.uint8) if tensor.dtype != torch.bfloat16
                                   else tensor.view(torch.int16)), name
            assert not torch.equal(fetched["lm_head.weight"], sd1["lm_head.weight"])

            await control.delete_version(1)
            assert await control.list_versions() == [2]
            with pytest.raises(KeyError, match="policy/v1"):
                await control.get_state_dict(1)
            with pytest.raises(Exception, match="policy/v1"):
                await reader.fetch.call_one(1)
            again = await control.get_state_dict(2)
            assert torch.equal(again["model.norm.weight"], sd2["model.norm.weight"])
        finally:
            await stop(reader)
            await control.stop()

    asyncio.run(main())
