"""The ROCm launch tables as pure functions, for every listed architecture."""

import pytest

from dflash_rocm.backends.rocm import settings, tables
from dflash_rocm.platform import platform_for_arch

ARCHS = tables.SUPPORTED_ARCHS


def workload(arch, batch=1, query_len=16, key_span=8192, hq=32, hk=8, d=128, fp8=False):
    return tables.AttentionWorkload(arch, batch, query_len, key_span, hq, hk, d, fp8)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_has_a_table_whose_last_rule_always_applies(arch):
    rules = tables.rules_for(arch)
    assert rules[-1].applies(workload(arch))
    family = platform_for_arch(arch).family
    assert all(r.name.startswith(("cdna", "rdna")) for r in rules)
    assert all(r.name.startswith(family[:4]) or r.name.startswith("cdna4") for r in rules)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_configs_are_valid_for_every_shape(arch, group, d):
    for fp8 in (False, True):
        for span in (16, 1024, 8192, 131072):
            for batch in (1, 8, 64):
                name, cfg = tables.attention_config(workload(arch, batch, 16, span, 8 * group, 8, d, fp8), 16)
                assert cfg.block_m >= group and cfg.queries_per_tile(group) >= 1
                assert 1 <= cfg.num_segments <= tables.MAX_SEGMENTS[platform_for_arch(arch).family]
                assert cfg.num_segments & (cfg.num_segments - 1) == 0
                assert span // cfg.num_segments >= min(span, 128)


@pytest.mark.parametrize("arch", ARCHS)
def test_split_kv_fills_the_device_for_one_request(arch):
    """One request x 8 KV heads is 8 programs: the table splits keys to fill the CUs."""
    p = platform_for_arch(arch)
    _, cfg = tables.attention_config(workload(arch, batch=1, key_span=131072), 16)
    tiles = tables.attention_grid_tiles(1, 16, cfg.queries_per_tile(4))
    assert tiles * 8 * cfg.num_segments >= min(p.compute_units, tiles * 8 * tables.MAX_SEGMENTS[p.family])
    _, full = tables.attention_config(workload(arch, batch=64, key_span=131072), 16)
    assert full.num_segments <= cfg.num_segments


@pytest.mark.parametrize("arch", ARCHS)
def test_short_sequences_are_not_split(arch):
    _, cfg = tables.attention_config(workload(arch, key_span=100), 16)
    assert cfg.num_segments == 1


def test_wave64_cdna_and_wave32_rdna_differ():
    cdna = tables.attention_config(workload("gfx942"), 16)[1]
    rdna = tables.attention_config(workload("gfx1100"), 16)[1]
    assert cdna.block_m > rdna.block_m and cdna.num_segments > rdna.num_segments
    assert tables.select_rule(workload("gfx950")).name == "cdna4-wide-lds"  # 160 KiB LDS
    assert tables.select_rule(workload("gfx942")).name == "cdna-default"


@pytest.mark.parametrize("arch,expected", [("gfx942", "cdna-d256"), ("gfx1201", "rdna-d256")])
def test_head_dim_256_rules(arch, expected):
    assert tables.select_rule(workload(arch, d=256)).name == expected


def test_rule_order_fp8_and_short_queries():
    assert tables.select_rule(workload("gfx942", fp8=True)).name == "cdna-fp8"
    assert tables.select_rule(workload("gfx1201", fp8=True)).name == "rdna-fp8"
    assert tables.select_rule(workload("gfx1100", query_len=4, hq=8, hk=2)).name == "rdna-short-query"


def test_queries_past_the_limit_take_the_unsegmented_path():
    name, cfg = tables.attention_config(workload("gfx1100", query_len=17), 16)
    assert name == "unsegmented" and cfg.num_segments == 1
    name, _ = tables.attention_config(workload("gfx1100", query_len=16), 16)
    assert name != "unsegmented"
    name, _ = tables.attention_config(workload("gfx1100", query_len=4000), None)
    assert name != "unsegmented"


def test_unknown_family_has_no_table():
    with pytest.raises(ValueError, match="no ROCm table"):
        tables.rules_for("sm_90")


@pytest.mark.parametrize("arch", ARCHS)
def test_precompute_config_splits_the_hidden_size_when_the_grid_is_small(arch):
    p = platform_for_arch(arch)
    small = tables.precompute_config(arch, num_tokens=16, hidden=4096, num_heads_total=80, head_dim=128)
    big = tables.precompute_config(arch, num_tokens=8192, hidden=4096, num_heads_total=80, head_dim=128)
    assert small.split_k >= 1 and big.split_k == 1 and big.block_t >= small.block_t
    assert 80 * small.split_k >= min(2 * p.compute_units, 80 * (4096 // (4 * small.block_k)))


def test_query_limit_env_wins_over_configured(monkeypatch):
    monkeypatch.delenv("DFLASH_ROCM_QUERY_LIMIT", raising=False)
    previous = settings.current()
    try:
        settings.configure(query_limit=16)
        assert settings.query_limit() == 16
        monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", "8")
        assert settings.query_limit() == 8
        monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", "many")
        with pytest.raises(ValueError, match="DFLASH_ROCM_QUERY_LIMIT"):
            settings.query_limit()
        with pytest.raises(ValueError, match="unknown ROCm setting"):
            settings.configure(qlimit=3)
    finally:
        settings.configure(**previous.__dict__)


@pytest.mark.parametrize("mode,arch,expected", [("auto", "gfx1100", True), ("auto", "gfx942", False),
                                                ("1", "gfx942", True), ("0", "gfx1201", False)])
def test_tuning_mode(monkeypatch, mode, arch, expected):
    monkeypatch.setenv("DFLASH_ROCM_TUNE", mode)
    assert settings.tuning_enabled(platform_for_arch(arch)) is expected
    monkeypatch.setenv("DFLASH_ROCM_TUNE", "sometimes")
    with pytest.raises(ValueError, match="DFLASH_ROCM_TUNE"):
        settings.tuning_enabled(platform_for_arch(arch))


def test_grids_use_the_detected_compute_unit_count():
    """A 228-CU MI300A is not sized like a 304-CU MI300X: the backend passes the detected
    count into the table (one request x 16 KV heads is 16 programs, and the split aims
    for two programs per CU)."""
    import torch

    from dflash_rocm.backends import rocm
    from dflash_rocm.ops.attention import attention_call
    from dflash_rocm.platform import simulate_platform

    def call():
        q = torch.zeros(16, 32, 128, dtype=torch.bfloat16)
        cache = torch.zeros(2048, 16, 16, 128, dtype=torch.bfloat16)
        return attention_call(q, cache, cache, torch.zeros(1, 2048, dtype=torch.int32),
                              torch.tensor([0, 16], dtype=torch.int32), torch.tensor([32768], dtype=torch.int32),
                              validate=False, max_query_len=16, max_seq_len=32768)

    with simulate_platform("gfx942") as flagship:
        w = rocm.attention_workload(call(), flagship)
        assert w.compute_units == 304 and rocm.attention_config(call())[1].num_segments == 64
    with simulate_platform("gfx942", compute_units=228) as mi300a:
        w = rocm.attention_workload(call(), mi300a)
        assert w.compute_units == 228 and rocm.attention_config(call())[1].num_segments == 32
    small = tables.precompute_config("gfx942", num_tokens=16, hidden=4096, num_heads_total=80, head_dim=128,
                                     compute_units=8)
    assert small.split_k == 1  # 80 programs already cover 2 x 8 CUs
