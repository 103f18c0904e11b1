"""On gloo, ``comm.reduce_scatter`` and ``comm.all_gather`` run as direct exchanges
(``raydeep.comm.exchange``): they must give what gloo's own collectives give, synchronous and
asynchronous, several in flight at once, in a subgroup, and with an all-gather's input inside its
output (a ZeRO shard in its flat buffer)."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks


def _against_gloo(chunk: int) -> dict:
    import torch.distributed as dist

    from raydeep import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(world * chunk, generator=g) for _ in range(3)]
    out = {}
    # Three reduce-scatters in flight at once, waited in reverse order.
    mine = [torch.empty(chunk) for _ in inputs]
    pending = [comm.reduce_scatter(o, x, async_op=True) for o, x in zip(mine, inputs)]
    for p in reversed(pending):
        p.wait()
    theirs = [torch.empty(chunk) for _ in inputs]
    for o, x in zip(theirs, inputs):
        dist.reduce_scatter_tensor(o, x.clone())
    out["reduce_scatter"] = [(a - b).abs().max().item() for a, b in zip(mine, theirs)]
    out["inputs_unchanged"] = all(torch.equal(x, torch.randn(world * chunk, generator=torch.Generator().manual_seed(
        100 + rank))) for x in inputs[:1])
    # All-gather synchronous, from a separate tensor and from this rank's chunk of the output.
    shard = torch.randn(chunk, generator=g)
    full = torch.empty(world * chunk)
    comm.all_gather(full, shard)
    expected = torch.empty(world * chunk)
    dist.all_gather_into_tensor(expected, shard.clone())
    out["all_gather"] = torch.equal(full, expected)
    inplace = torch.zeros(world * chunk)
    inplace[rank * chunk:(rank + 1) * chunk] = shard
    comm.all_gather(inplace, inplace[rank * chunk:(rank + 1) * chunk], async_op=True).wait()
    out["all_gather_in_place"] = torch.equal(inplace, expected)
    # A subgroup of the even ranks: group ranks differ from global ranks.
    evens = list(range(0, world, 2))
    group = dist.new_group(evens)
    if rank in evens:
        x = inputs[0][:len(evens) * chunk].contiguous()
        o, ref = torch.empty(chunk), torch.empty(chunk)
        comm.reduce_scatter(o, x, group=group)
        dist.reduce_scatter_tensor(ref, x.clone(), group=group)
        out["subgroup"] = (o - ref).abs().max().item()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_collectives_match_gloo(world):
    for result in run_ranks(_against_gloo, world, 1000):
        assert result["all_gather"] and result["all_gather_in_place"] and result["inputs_unchanged"]
        # Two addends: the same sum bit for bit. Three: the two sums may add in different orders,
        # two roundings each of at most half an ulp of a partial sum below 16 (randn stays within
        # +-5 here), so they differ by at most 4 x 2^-21.
        bound = 0.0 if world == 2 else 2.0 ** -19
        assert max(result["reduce_scatter"]) <= bound, result
        if "subgroup" in result:
            assert result["subgroup"] <= bound, result


def test_gloo_collectives_benchmark_prints_its_ratios(capsys):
    from benchmarks.gloo_collectives import main

    main(["--world", "2", "--sizes", "1000,4000", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1000", "4000"]
    assert all(len(row) == 8 and float(row[4]) > 0 and float(row[7]) > 0 for row in rows), lines
