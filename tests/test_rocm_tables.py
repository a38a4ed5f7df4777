"""The ROCm launch tables as pure functions, for every listed architecture: the structure
of the tables (every architecture has rows, rows ordered, every row reachable, a row for
every workload, within the stage limit and the LDS) and the rules the picking code adds."""

import dataclasses
import itertools

import pytest

from dflash_rocm.backends.rocm import settings, tables
from dflash_rocm.backends.triton.common import next_pow2
from dflash_rocm.backends.triton.launch_config import IN_KERNEL_MERGE_SEGMENTS
from dflash_rocm.planning import record_for
from dflash_rocm.platform import platform_for_arch

ARCHS = tables.SUPPORTED_ARCHS


def workload(arch, batch=1, query_len=16, key_span=8192, hq=32, hk=8, d=128, fp8=False):
    return tables.AttentionWorkload(arch, batch, query_len, key_span, hq, hk, d, fp8)


@pytest.mark.parametrize("arch", ARCHS)
def test_gfx12_loops_are_single_stage(arch):
    """Triton's pipelined loops over buffer loads gave wrong decode output on gfx12 (vLLM
    #62697): every attention and precompute config there takes one stage."""
    limit = tables.stage_limit(arch)
    assert limit == (1 if arch.startswith("gfx12") else 2)
    for tokens in (16, 64, 256, 1024, 4096):
        cfg = tables.precompute_config(arch, num_tokens=tokens, hidden=4096, num_heads_total=80, head_dim=128)
        assert cfg.num_stages <= limit
    for fp8 in (False, True):
        for span in (1024, 131072):
            assert tables.attention_config(workload(arch, 8, 16, span, fp8=fp8), 16)[1].num_stages <= limit


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
                w = workload(arch, batch, 16, span, 8 * group, 8, d, fp8)
                name, cfg = tables.attention_config(w, 16)
                assert cfg.block_m >= group and cfg.queries_per_tile(group) >= 1
                assert 1 <= cfg.num_segments <= tables.MAX_SEGMENTS[platform_for_arch(arch).family]
                assert cfg.num_segments & (cfg.num_segments - 1) == 0
                # The device packs segments to >= min_segment_keys keys: no more than twice
                # as many segments as the span holds of those.
                assert cfg.min_segment_keys >= 128
                assert cfg.num_segments <= max(1, 2 * span // cfg.min_segment_keys)
                # Few partials: the last segment merges; more: merger programs only where fewer
                # of them than CUs (else segments could wait for room), else a second launch.
                tiles_heads = batch * -(-16 // cfg.queries_per_tile(group)) * 8
                token_rows = min(cfg.block_m, next_pow2(group))
                p = platform_for_arch(arch)
                xcds = 8 if p.family == "cdna" else 1  # MI300/MI355 deal programs to XCDs round-robin

                def fits(rows):
                    mergers = -(-tiles_heads * cfg.block_m // rows // xcds)
                    return rows <= cfg.block_m and mergers < p.compute_units // xcds

                shares = [r for r in (token_rows << i for i in range(8)) if fits(r)]  # 2x the rows, 1/2 the mergers
                if cfg.num_segments <= IN_KERNEL_MERGE_SEGMENTS and tables.select_rule(w).merges_last(w):
                    assert (cfg.merge, cfg.merge_rows) == ("last", 0)
                elif shares:
                    assert (cfg.merge, cfg.merge_rows) == ("tail", 0 if shares[0] == token_rows else shares[0])
                else:
                    assert (cfg.merge, cfg.merge_rows) == ("launch", 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_split_kv_fills_the_device_for_one_request(arch):
    """One request x 8 KV heads is 8 programs: the table splits keys to fill the CUs."""
    p = platform_for_arch(arch)
    _, cfg = tables.attention_config(workload(arch, batch=1, key_span=131072), 16)
    tiles = tables.attention_grid_tiles(1, 16, cfg.queries_per_tile(4))
    assert tiles * 8 * cfg.num_segments >= min(p.compute_units, tiles * 8 * tables.MAX_SEGMENTS[p.family])
    _, full = tables.attention_config(workload(arch, batch=64, key_span=131072), 16)
    assert full.num_segments <= cfg.num_segments


def test_small_batches_on_cdna_merge_by_merger_programs_and_a_large_batch_does_not():
    """Batch 1 x 8 KV heads x 16 mergers is 128 programs, 16 per XCD of MI300X's 38 CUs:
    merged in the same launch without one program reading every partial; batch 4 takes
    8-row mergers (256: 32 per XCD); batch 8 split 16 ways takes 16-row mergers (256: 32 per
    XCD; with few segments, the last one merges); batch 64's would fill the XCDs even a
    tile to a merger: a second launch."""
    b1 = tables.attention_config(workload("gfx942", batch=1, key_span=8192), 16)[1]
    assert (b1.merge, b1.merge_rows) == ("tail", 0)
    b4 = tables.attention_config(workload("gfx942", batch=4, key_span=131072), 16)[1]
    assert b4.num_segments > IN_KERNEL_MERGE_SEGMENTS and (b4.merge, b4.merge_rows) == ("tail", 8)
    from dflash_rocm.backends.triton.launch_config import merge_for

    mi300 = platform_for_arch("gfx942")
    assert merge_for(16, 8 * 8, 64, 4, mi300) == ("tail", 16)  # 8 tiles x 8 heads: 128 or 64 mergers per XCD, 32
    assert merge_for(16, 8 * 8, 64, 4, mi300, last_merges=False) == ("tail", 16)
    assert merge_for(8, 8 * 8, 64, 4, mi300) == ("last", 0)
    assert merge_for(16, 64 * 8, 64, 4, mi300) == ("launch", 0)  # 64 tiles x 8 heads: 64 mergers per XCD at least


def test_merger_programs_leave_room_in_every_xcd():
    """MI300 deals programs to its 8 XCDs round-robin: each XCD must keep a CU that no
    waiting merger holds (16 mergers per (tile, KV head) with a 64-row tile of 4 heads)."""
    from dflash_rocm.backends.triton.launch_config import tail_merge_fits

    mi300 = platform_for_arch("gfx942")  # 304 CUs, 38 per XCD
    assert tail_merge_fits(8 * 16, mi300) and not tail_merge_fits(32 * 16, mi300)  # 16 vs 64 per XCD
    assert tail_merge_fits(37 * 8, mi300) and not tail_merge_fits(37 * 8 + 1, mi300)  # 37 vs 38 in the fullest
    small = platform_for_arch("gfx942", compute_units=16)  # 2 CUs per XCD
    assert tail_merge_fits(8, small) and not tail_merge_fits(16, small)  # 1 vs 2 mergers per XCD
    rdna = platform_for_arch("gfx1100")  # 96 CUs, dealt as one
    assert tail_merge_fits(95, rdna) and not tail_merge_fits(96, rdna)


@pytest.mark.parametrize("arch", ARCHS)
def test_short_sequences_are_not_split(arch):
    _, cfg = tables.attention_config(workload(arch, key_span=100), 16)
    assert cfg.num_segments == 1


def test_cdna_rdna3_and_rdna4_take_their_own_tiles():
    cdna = tables.attention_config(workload("gfx942"), 16)[1]
    rdna3 = tables.attention_config(workload("gfx1100"), 16)[1]
    rdna4 = tables.attention_config(workload("gfx1201"), 16)[1]
    assert cdna.matrix_instr_nonkdim == 16 and not rdna3.matrix_instr_nonkdim  # 16-row MFMA tiles on CDNA
    assert cdna.num_segments > rdna3.num_segments  # 304 CUs to fill, not 96
    assert rdna3.block_n < rdna4.block_n and rdna3.num_warps > rdna4.num_warps  # RDNA3 WMMA register pressure
    assert tables.select_rule(workload("gfx950")).name == tables.select_rule(workload("gfx942")).name == "cdna-default"
    assert not any(cfg.waves_per_eu for cfg in (cdna, rdna3, rdna4))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_query_block_that_fits_is_one_tile(arch):
    """16 queries x 4 heads = 64 rows: one tile per request (no tile exits at once)."""
    w = workload(arch, batch=8)
    _, cfg = tables.attention_config(w, 16)
    assert cfg.queries_per_tile(w.group) >= w.query_len
    assert cfg.block_m // 16 >= cfg.num_warps or not cfg.matrix_instr_nonkdim  # no MFMA replication


@pytest.mark.parametrize("arch,expected", [("gfx942", "cdna-d256"), ("gfx1201", "rdna-d256")])
def test_head_dim_256_rules(arch, expected):
    assert tables.select_rule(workload(arch, d=256)).name == expected


def test_rule_order_fp8_and_short_queries():
    assert tables.select_rule(workload("gfx942", key_span=4096, fp8=True)).name == "cdna-gfx942-fp8-long"
    assert tables.select_rule(workload("gfx942", key_span=4095, fp8=True)).name == "cdna-default"
    assert tables.select_rule(workload("gfx942", key_span=8192)).name == "cdna-default"
    assert tables.select_rule(workload("gfx1201", fp8=True)).name == "rdna4-fp8"
    assert tables.select_rule(workload("gfx1100", fp8=True)).name == "rdna3-default"
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
def test_precompute_config_splits_a_single_token_tile_or_a_last_partial_round(arch):
    p = platform_for_arch(arch)
    small = tables.precompute_config(arch, num_tokens=16, hidden=4096, num_heads_total=80, head_dim=128)
    mid = tables.precompute_config(arch, num_tokens=256, hidden=4096, num_heads_total=80, head_dim=128)
    big = tables.precompute_config(arch, num_tokens=8192, hidden=4096, num_heads_total=80, head_dim=128)
    assert small.block_t >= 16 and small.whole_tiles == 0  # one token tile: every head split
    assert 80 * small.split_k >= min(p.compute_units, 80 * (4096 // (4 * small.block_k)))
    for config, tokens in ((mid, 256), (big, 8192)):
        tiles = -(-tokens // config.block_t) * 80
        if config.split_k > 1:  # full rounds whole, a last round of at most half the CUs split
            assert config.whole_tiles % p.compute_units == 0 and 0 < tiles - config.whole_tiles <= p.compute_units / 2
        else:
            assert config.whole_tiles == 0
    if arch == "gfx942":  # 320 tiles of 64 tokens on 304 CUs: a round whole, 16 tiles split a part per CU
        assert (mid.block_t, mid.whole_tiles, mid.split_k) == (64, 304, 16)
    assert not any(c.waves_per_eu for c in (small, mid, big))
    assert all(c.num_xcds == (8 if p.family == "cdna" else 1) for c in (small, mid, big))


@pytest.mark.parametrize("arch", ARCHS)
def test_precompute_sums_squares_a_value_at_a_time_only_on_gfx950(arch):
    """gfx950's loop is bound by its vector work, which per-value squares shrink; the other
    architectures keep the 8-column groups (fewer registers: RDNA3 would lose waves)."""
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig

    for tokens in (16, 256, 8192):
        config = tables.precompute_config(arch, num_tokens=tokens, hidden=4096, num_heads_total=80, head_dim=128)
        assert config.square_group == (1 if arch == "gfx950" else 8)
    with pytest.raises(ValueError, match="square_group: expected 1 or 8"):
        PrecomputeLaunchConfig(square_group=4)


def test_tail_split_spreads_only_a_short_last_round():
    from dflash_rocm.backends.triton.launch_config import tail_split

    assert tail_split(640, 304) == (608, 4)  # 32 tiles left: 128 parts, a share for many CUs
    assert tail_split(320, 304) == (304, 16)  # 16 left: 256 parts, at most one per CU
    assert tail_split(324, 304) == (304, 4)  # 20 left: 16 ways would give some CUs two parts
    assert tail_split(640, 256) == (512, 2)  # 128 left: 4 ways would give more than 1.75 parts per CU
    assert tail_split(5120, 304) == (0, 1)  # 256 left: most CUs busy anyway
    assert tail_split(200, 304) == (0, 1)  # no full round
    assert tail_split(608, 304) == (0, 1)  # no last round


def test_query_limit_env_wins_over_configured(monkeypatch):
    monkeypatch.delenv("DFLASH_ROCM_QUERY_LIMIT", raising=False)
    previous = settings.current()
    try:
        settings.configure(query_limit=16)
        assert settings.query_limit() == 16
        monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", "8")
        assert settings.query_limit() == 8
        monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", "many")  # refused with a warning: the configured one applies
        assert settings.query_limit() == 16
        with pytest.raises(ValueError, match="unknown setting"):
            settings.configure(qlimit=3)
    finally:
        settings.configure(**previous._asdict())


@pytest.mark.parametrize("mode,arch,expected", [("auto", "gfx1100", True), ("auto", "gfx942", False),
                                                ("1", "gfx942", True), ("0", "gfx1201", False)])
def test_tuning_mode(monkeypatch, mode, arch, expected):
    monkeypatch.setenv("DFLASH_ROCM_TUNE", mode)
    assert settings.tuning_enabled(platform_for_arch(arch)) is expected
    monkeypatch.setenv("DFLASH_ROCM_TUNE", "sometimes")  # refused with a warning: the default (auto) applies
    assert settings.tuning_enabled(platform_for_arch(arch)) is (platform_for_arch(arch).family == "rdna")


def test_grids_use_the_detected_compute_unit_count():
    """A 228-CU MI300A is not sized like a 304-CU MI300X: the backend passes the detected
    count into the table (one request x 8 KV heads is 8 programs; the split aims for a
    number of programs per CU)."""
    import torch

    from dflash_rocm.backends import rocm
    from dflash_rocm.ops.attention import attention_call
    from dflash_rocm.platform import simulate_platform

    def call():
        q = torch.zeros(16, 32, 128, dtype=torch.bfloat16)
        cache = torch.zeros(512, 16, 8, 128, dtype=torch.bfloat16)
        return attention_call(q, cache, cache, torch.zeros(1, 512, dtype=torch.int32),
                              torch.tensor([0, 16], dtype=torch.int32), torch.tensor([8192], dtype=torch.int32),
                              validate=False, max_query_len=16, max_seq_len=8192)

    with simulate_platform("gfx942") as flagship:
        assert rocm.attention_workload(call(), flagship).compute_units == 304
        full = rocm.attention_choice(*record_for("draft_attention", "rocm", call()))[1].num_segments
    with simulate_platform("gfx942", compute_units=228) as mi300a:
        assert rocm.attention_workload(call(), mi300a).compute_units == 228
        fewer = rocm.attention_choice(*record_for("draft_attention", "rocm", call()))[1].num_segments
    assert fewer < full
    small = tables.precompute_config("gfx942", num_tokens=16, hidden=4096, num_heads_total=80, head_dim=128,
                                     compute_units=8)
    assert small.split_k == 1  # 80 programs already cover 8 CUs


# ---- the tables' structure ----------------------------------------------------------------

def precompute_workloads(arch):
    """A grid of precompute calls on ``arch``: token counts on both sides of every row's
    bounds, head totals that fill a device from a fraction of a round to many rounds."""
    tokens = (1, 16, 17, 32, 33, 64, 65, 96, 128, 192, 224, 225, 256, 320, 352, 353, 384, 448, 512, 576, 639, 640,
              704, 768, 1023, 1024, 1472, 2048, 4096, 8192, 16384)
    for n, heads, d, cus in itertools.product(tokens, (8, 40, 80, 86, 156, 172, 320, 2000), (64, 128, 256), (None, 16)):
        yield tables.PrecomputeWorkload(arch, n, 4096, heads, d, cus)


def attention_workloads(arch):
    for batch, q, span, (hq, hk), d, fp8 in itertools.product((1, 8, 64), (1, 4, 16), (100, 8192, 131072),
                                                              ((32, 8), (8, 8), (64, 4)), (64, 128, 256),
                                                              (False, True)):
        yield workload(arch, batch, q, span, hq, hk, d, fp8)


CONDITIONS = {"precompute": ("min_tokens", "max_tokens", "max_head_dim", "max_rounds", "tail_ways", "full_tiles"),
              "attention": ("archs", "min_head_dim", "fp8", "max_query_rows", "min_key_span")}


def unconditional(rule, kind):
    defaults = {f.name: f.default for f in dataclasses.fields(rule)}
    return all(getattr(rule, name) == defaults[name] for name in CONDITIONS[kind])


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_has_tables_whose_last_row_has_no_condition(arch):
    """A row applies to every workload: each table ends in a row with no condition."""
    assert unconditional(tables.precompute_table(arch).rules[-1], "precompute")
    assert unconditional(tables.rules_for(arch)[-1], "attention")
    assert sum(unconditional(r, "precompute") for r in tables.precompute_table(arch).rules) == 1


def test_every_precompute_table_serves_a_supported_arch_and_rows_have_unique_names():
    served = {id(tables.precompute_table(arch)) for arch in ARCHS}
    assert served == {id(t) for t in tables.PRECOMPUTE_TABLES.values()}
    for table in tables.PRECOMPUTE_TABLES.values():
        names = [r.name for r in table.rules]
        assert len(set(names)) == len(names)
    with pytest.raises(ValueError, match="no ROCm precompute table"):
        tables.precompute_table("sm_90")


@pytest.mark.parametrize("key", list(tables.PRECOMPUTE_TABLES))
def test_precompute_rows_are_ordered_by_their_token_bound(key):
    """A row for fewer tokens comes first: token bounds never fall down the table (no bound
    counts as unbounded), so a wider row cannot hide a narrower one that follows it."""
    bounds = [r.max_tokens if r.max_tokens is not None else float("inf") for r in tables.PRECOMPUTE_TABLES[key].rules]
    assert bounds == sorted(bounds)


@pytest.mark.parametrize("table", [tables.CDNA_RULES, tables.RDNA_RULES, *tables.PRECOMPUTE_TABLES.values()],
                         ids=["cdna", "rdna", *tables.PRECOMPUTE_TABLES])
def test_every_row_is_picked_by_some_workload(table):
    """No row is shadowed by the rows before it, on the architectures that use the table."""
    if isinstance(table, tables.PrecomputeTable):
        archs = [a for a in ARCHS if tables.precompute_table(a) is table]
        picked = {tables.select_precompute_rule(w).name for a in archs for w in precompute_workloads(a)}
        rows = table.rules
    else:
        archs = [a for a in ARCHS if tables.rules_for(a) is table]
        picked = {tables.select_rule(w).name for a in archs for w in attention_workloads(a)}
        rows = table
    assert archs and picked == {r.name for r in rows}


@pytest.mark.parametrize("arch", ARCHS)
def test_no_row_takes_more_stages_than_the_arch_allows(arch):
    """gfx12 takes one stage everywhere (:func:`tables.stage_limit`); the rows say so themselves."""
    assert tables.stage_limit(arch) == (1 if arch.startswith("gfx12") else 2)
    rows = tables.precompute_table(arch).rules + tables.rules_for(arch)
    assert all(r.num_stages <= tables.stage_limit(arch) for r in rows
               if not getattr(r, "archs", ()) or arch.startswith(r.archs))


def operand_bytes(rows, cols_a, cols_b, stages, elem_bytes=2):
    """LDS a loop's two matrix operands take at the least, one buffer per pipeline stage."""
    return stages * (rows + cols_b) * cols_a * elem_bytes


def attention_operand_bytes(w, c):
    """LDS the attention loop's operands take at the least: the query tile (loaded once,
    2 bytes an element), and a K and a V tile per pipeline stage in the cache's element
    size (an fp8 K tile widened at its load in 2)."""
    kv = 1 if w.fp8 else 2
    k = 2 if c.fp8_k_at_load else kv
    return c.block_m * w.head_dim * 2 + c.num_stages * c.block_n * w.head_dim * (k + kv)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_config_fits_the_arch_lds(arch):
    """The operand tiles of every config the tables give, one buffer per stage, fit the
    architecture's LDS (the compiled LDS of the audited sweep: tests/test_audit.py)."""
    lds = platform_for_arch(arch).lds_bytes
    for w in precompute_workloads(arch):
        c = tables.precompute_config(arch, num_tokens=w.num_tokens, hidden=w.hidden, num_heads_total=w.num_heads_total,
                                     head_dim=w.head_dim, compute_units=w.compute_units)
        assert operand_bytes(c.block_t, c.block_k, c.heads * w.head_dim, c.num_stages) <= lds, (w, c)
    for w in attention_workloads(arch):
        c = tables.attention_config(w, 16)[1]
        assert attention_operand_bytes(w, c) <= lds, (w, c)


def test_rows_are_keyword_data():
    with pytest.raises(TypeError):
        tables.PrecomputeRule("x", 64, 8, 1)
    with pytest.raises(ValueError, match="split: expected one of"):
        tables.PrecomputeRule(name="x", block_t=64, num_warps=8, num_stages=1, split="rows")
