"""Tensor parallelism: the per-rank shapes the tables serve, the launch tables' choice for
them (a hidden-size split whenever the grid is under one round of the device), the modelled
``fc`` question, and the what-if launches ``bench --assumptions`` times on a GPU."""

import dataclasses

import pytest

from dflash_rocm import assumptions_bench as assumptions
from dflash_rocm.peer import fc
from dflash_rocm.backends.rocm import tables
from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig, default_precompute_config
from dflash_rocm.platform import platform_for_arch
from dflash_rocm.workloads import SHAPES, shape_named

QWEN = SHAPES["qwen3-8b-dflash-b16"]


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_a_rank_holds_its_share_of_the_heads(shape):
    """vLLM's QKVParallelLinear: query heads / TP, KV heads / TP (one, replicated, when there
    are fewer KV heads than ranks); the hidden size, layers and head size stay."""
    assert shape.per_rank(1) is shape
    for tp in shape.tp_degrees():
        rank = shape.per_rank(tp)
        assert rank.q_heads * tp == shape.q_heads
        assert rank.kv_heads == max(1, shape.kv_heads // tp)
        assert (rank.hidden, rank.layers, rank.head_dim, rank.sliding_window) == (
            shape.hidden, shape.layers, shape.head_dim, shape.sliding_window)
        assert shape_named(rank.name) == rank
    assert 8 in shape.tp_degrees() and 3 not in shape.tp_degrees()


@pytest.mark.parametrize("tp", [0, 3, 5, 6, 7, 12, True, 2.0])
def test_a_degree_vllm_cannot_shard_is_refused(tp):
    with pytest.raises(ValueError, match="tp"):
        QWEN.per_rank(tp)


def test_an_unknown_shape_name_is_refused():
    for name in ("nope", "qwen3-8b-dflash-b16@tpx", "nope@tp8"):
        with pytest.raises(ValueError, match="unknown draft shape"):
            shape_named(name)


def _heads_total(shape):
    return 2 * shape.layers * shape.kv_heads


TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx1100", "gfx1201", "sm_90"])
def test_a_grid_under_one_round_splits_the_hidden_size(arch):
    """For every shape of ``workloads`` at every TP degree: beyond one token tile, a launch
    whose tiles (one head row each) would not fill one round of the CUs (SMs) splits the
    hidden size of every tile, at least 2 ways and into at most the table's parts per unit;
    one that fills a round is never split whole."""
    platform = platform_for_arch(arch)
    for shape in SHAPES.values():
        for tp in shape.tp_degrees():
            rank = shape.per_rank(tp)
            for n in TOKENS:
                kw = dict(num_tokens=n, hidden=rank.hidden, num_heads_total=_heads_total(rank),
                          head_dim=rank.head_dim)
                cfg = (default_precompute_config(platform, **kw) if arch.startswith("sm") else
                       tables.precompute_config(arch, **kw))
                tiles = -(-n // cfg.block_t) * _heads_total(rank)  # one head row a tile (heads=2 pairs two)
                where = (shape.name, tp, n, cfg)
                if n <= 64:
                    continue  # one token tile: split until the heads fill the CUs (test_rocm_tables)
                # RDNA and NVIDIA fill only grids of at most half their units (the parts' sums cost
                # more than idle units above that)
                under = 1 if platform.family == "cdna" else 0.5
                if tiles < under * platform.compute_units:
                    assert cfg.split_k > 1 and cfg.whole_tiles == 0 and cfg.heads == 1, where
                    assert rank.hidden // cfg.split_k >= 4 * cfg.block_k, where
                    assert cfg.split_k == 2 or tiles * cfg.split_k <= 4 * platform.compute_units, where
                elif cfg.split_k > 1:
                    assert cfg.whole_tiles > 0, where  # only a last partial round is split


def test_the_fc_model_reads_a_ranks_share_and_pays_only_under_its_break_even_latency():
    """Sharded, a rank reads 1/TP of the weight; the all-gather's cost grows with the tokens;
    the break-even latency is the one at which the two cost the same."""
    link = fc.INTERCONNECTS["gfx942"]
    for tp in (2, 4, 8):
        for tokens in (16, 256, 1024):
            c = fc.fc_cost(QWEN, tp, tokens)
            assert c.weight_bytes == 2 * fc.AUX_LAYERS * QWEN.hidden ** 2
            assert c.weight_bytes_per_rank * tp == c.weight_bytes
            assert c.sharded_gemm_s < c.replicated_s
            transfer = c.all_gather_s - link.all_gather_latency_s
            assert transfer == pytest.approx(2 * tokens * QWEN.hidden / tp / link.link_bytes_per_s)
            even = dataclasses.replace(c, all_gather_s=c.break_even_latency_s + transfer)
            assert even.sharded_s == pytest.approx(c.replicated_s)
    assert fc.fc_cost(QWEN, 8, 1024).all_gather_s > fc.fc_cost(QWEN, 8, 16).all_gather_s
    with pytest.raises(ValueError, match="interconnect"):
        fc.fc_cost(QWEN, 8, 16, arch="gfx1201")
    with pytest.raises(ValueError, match="tp"):
        fc.fc_cost(QWEN, 1, 16)


def test_inspect_prints_the_fc_table_for_per_rank_shapes_only():
    text = fc.format_fc([QWEN.per_rank(8), QWEN.per_rank(4)], ["gfx942", "sm_90"])
    assert "MODELLED, NOT MEASURED" in text and "estimate" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("gfx942 ")]
    assert {(r[2], r[3]) for r in rows} == {(tp, str(n)) for tp in ("8", "4") for n in fc.TOKENS}
    assert not any(line.startswith("sm_90 ") for line in text.splitlines())
    assert fc.format_fc([QWEN], ["gfx942"]) == ""
    assert all(len(line) <= 100 for line in text.splitlines())


def test_the_what_ifs_are_the_table_undone_and_the_issues_split_and_differ_from_it():
    table = PrecomputeLaunchConfig(block_t=32, split_k=8, num_warps=4)
    configs = assumptions.what_if_configs(table, hidden=4096, tokens=256)
    assert configs["table"] == table
    assert configs["no split"].split_k == 1 and configs["no split"].heads == 1
    assert configs["no split, K and V paired"].heads == 2
    assert "no split, K and V paired" not in assumptions.what_if_configs(table, hidden=4096, tokens=32)
    issue = configs["128-token tiles, 8-way"]
    assert (issue.block_t, issue.split_k, issue.heads) == (128, 8, 1)
    assert configs["half the split"].split_k == 4 and configs["twice the split"].split_k == 16
    assert len(set(configs.values())) == len(configs)
    narrow = assumptions.what_if_configs(table, hidden=256, tokens=16)  # a part keeps a 64-column step at least
    assert "twice the split" not in narrow and narrow["128-token tiles, 8-way"].split_k == 4
    whole = assumptions.what_if_configs(dataclasses.replace(table, whole_tiles=304), hidden=4096, tokens=4096)
    assert "half the split" not in whole  # a last round's split is not the per-rank rule's


def test_bench_and_inspect_refuse_a_degree_vllm_cannot_shard(capsys):
    from dflash_rocm.cli import main

    for argv in (["bench", "--tp", "3", "--device", "cpu", "--op", "precompute"],
                 ["inspect", "--tp", "2,3", "--target", "gfx942", "--op", "precompute", "--quiet"]):
        assert main(argv) == 2
        assert "tp 3" in capsys.readouterr().err


def test_bench_plans_the_per_rank_shape():
    import torch

    from dflash_rocm import bench

    plan = bench.default_plan(torch.device("cpu"), tp=8, ops=["precompute"])
    assert [(s.q_heads, s.kv_heads) for s in plan.shapes] == [(4, 1)]
    assert plan.shapes[0].name.endswith("@tp8")
