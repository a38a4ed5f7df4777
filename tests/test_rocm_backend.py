"""The rocm backend's kernel paths with every architecture's table, through the Triton
interpreter on CPU (a simulated platform): each table entry runs at least once and is
compared with the reference."""

import pytest
import torch

from dflash_rocm.planning import record_for
from hypothesis import given
from hypothesis import strategies as st

import dflash_rocm
from checks import check_attention, check_precompute
from dflash_rocm.backends import rocm
from dflash_rocm.backends.rocm import tables
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.platform import platform_for_arch, simulate_platform
from dflash_rocm.ops.attention import attention_call
from strategies import CPU_SIZES, PACKINGS, WEIGHT_FORMATS, attention_cases, precompute_cases
from support import needs_interpreter
from test_triton_backend import paged

pytestmark = needs_interpreter


def fp8_for(arch):
    return torch.float8_e4m3fnuz if arch.startswith("gfx94") else torch.float8_e4m3fn


def case_for(arch, rule):
    """Arguments of a call that selects ``rule`` on ``arch``, long enough to be split."""
    d, q_len, group, fp8 = 64, 8, 4, False
    if rule.name.endswith("d256"):
        d = 256
    if rule.name.endswith("fp8"):
        fp8 = True
    if rule.name == "rdna-short-query":
        q_len = 4
    seq = 2 * rule.min_keys_per_segment + 40
    args = paged([seq], [q_len], Hk=1, G=group, D=d, block_size=16, dtype=torch.bfloat16)
    if fp8:
        args = args[:1] + (args[1].to(fp8_for(arch)), args[2].to(fp8_for(arch))) + args[3:]
    return args


def reachable(arch, rule):
    """Whether the case built for ``rule`` selects it on ``arch`` (an earlier rule, such
    as RDNA3's default before RDNA4's fp8 rule, may shadow it there)."""
    call = attention_call(*case_for(arch, rule))
    with simulate_platform(arch):
        return tables.select_rule(rocm.attention_workload(call, rocm.platform_for(call.device))) == rule


RULE_CASES = [(arch, rule) for arch in tables.SUPPORTED_ARCHS for rule in tables.rules_for(arch)
              if reachable(arch, rule)]


@pytest.mark.parametrize("arch,rule", RULE_CASES, ids=[f"{a}-{r.name}" for a, r in RULE_CASES])
def test_every_table_entry_matches_the_reference(arch, rule):
    args = case_for(arch, rule)
    with simulate_platform(arch):
        source, config = rocm.attention_choice(*record_for("draft_attention", "rocm", attention_call(*args)))
        assert source == rule.name
        assert config.num_segments >= 2, "the case is long enough to be split"
        ref = dflash_rocm.draft_attention(*args, backend="reference")
        out = dflash_rocm.draft_attention(*args, backend="rocm")
    tol = 6e-2 if args[1].dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else 2e-2
    assert dflash_rocm.contract.relative_error(out, ref) < tol


@pytest.mark.parametrize("arch", ["gfx942", "gfx1100"])
def test_queries_past_the_query_limit_are_served_unsegmented(arch, monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", "4")
    args = paged([300], [7], Hk=1, G=4, D=64, block_size=16)
    with simulate_platform(arch):
        source, config = rocm.attention_choice(*record_for("draft_attention", "rocm", attention_call(*args)))
        out = dflash_rocm.draft_attention(*args, backend="rocm")
    assert source == "unsegmented" and config.num_segments == 1
    ref = dflash_rocm.draft_attention(*args, backend="reference")
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-3


@pytest.mark.parametrize("arch", tables.SUPPORTED_ARCHS)
@pytest.mark.parametrize("num_tokens,hidden", [(8, 640), (200, 96)])
def test_precompute_table_of_every_arch_matches_the_reference(arch, num_tokens, hidden):
    from strategies import make_generator, make_weights
    g = make_generator(7, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=hidden, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.bfloat16)
    states = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    caches = [torch.zeros(-(-num_tokens // 16) + 1, 16, 2, 32, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.randperm(caches[0].shape[0] * 16, generator=g)[:num_tokens]
    config = tables.precompute_config(arch, num_tokens=num_tokens, hidden=hidden, num_heads_total=8, head_dim=32)
    with simulate_platform(arch):
        k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, caches[:2], caches[2:], slots,
                                                           return_kv=True, backend="rocm")
    rk, rv = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                         backend="reference")
    assert dflash_rocm.contract.relative_error(k, rk) < 2e-2 and dflash_rocm.contract.relative_error(v, rv) < 2e-2
    assert config.block_t in (16, 32, 64) and (num_tokens > 16 or config.split_k > 1)


@given(st.sampled_from(tables.SUPPORTED_ARCHS), attention_cases(CPU_SIZES, packings=PACKINGS))
def test_rocm_attention_property(arch, case):
    with simulate_platform(arch):
        check_attention(case, "rocm")


@given(st.sampled_from(tables.SUPPORTED_ARCHS), precompute_cases(CPU_SIZES, packings=PACKINGS))
def test_rocm_precompute_property(arch, case):
    with simulate_platform(arch):
        check_precompute(case, "rocm")


@given(st.sampled_from(tables.SUPPORTED_ARCHS),
       precompute_cases(CPU_SIZES, packings=PACKINGS, weight_formats=WEIGHT_FORMATS))
def test_rocm_precompute_with_fp8_weights_property(arch, case):
    """fp8 K/V rows under every architecture's table: the triton kernel's fp8-row path."""
    with simulate_platform(arch):
        check_precompute(case, "rocm")


@pytest.mark.parametrize("arch", tables.SUPPORTED_ARCHS)
def test_rocm_reads_the_fp8_weight_format_its_hardware_converts_and_says_why_not_the_other(arch):
    """On the hardware (not simulated), an fp8 weight format the architecture cannot convert
    is declined with a reason naming it (gfx942: e4m3fnuz only; gfx950, gfx12: e4m3fn)."""
    platform = platform_for_arch(arch)
    native = platform.arch_info.fp8_dtype
    for dtype in FP8_DTYPES:
        reasons = rocm.RocmPrecompute.weight_reasons(dtype, platform)
        if dtype == native:
            assert reasons == [], (arch, dtype, reasons)
        else:
            assert reasons and "fp8 K/V weights" in reasons[0], (arch, dtype, reasons)


@pytest.mark.parametrize("arch", tables.SUPPORTED_ARCHS)
def test_rocm_says_where_reading_its_fp8_rows_is_modelled_slower_than_bf16_rows(arch):
    """A cost, not a capability: where the declared rule (backends/triton/weight_formats.py)
    names the architecture, the native fp8 rows are still read (``weight_reasons`` empty)
    but ``slower_weight_reasons`` gives the modelled figures; float rows never have one, and
    neither has the interpreter simulating the architecture."""
    from dflash_rocm.backends.triton import weight_formats

    platform = platform_for_arch(arch)
    native = platform.arch_info.fp8_dtype
    declared = any(arch.startswith(prefix) for prefix in weight_formats.FP8_ROWS_SLOWER)
    if native is None:  # RDNA3: no fp8 rows to weigh
        assert not declared
        return
    slower = rocm.RocmPrecompute.slower_weight_reasons(native, platform)
    assert rocm.RocmPrecompute.weight_reasons(native, platform) == []
    assert bool(slower) == declared, (arch, slower)
    if declared:
        assert "modelled slower" in slower[0] and arch in slower[0] and "N=256" in slower[0]
    assert rocm.RocmPrecompute.slower_weight_reasons(torch.bfloat16, platform) == []
    with simulate_platform(arch) as simulated:
        assert rocm.RocmPrecompute.slower_weight_reasons(native, simulated) == []


def test_auto_never_picks_rocm_for_cpu_tensors_even_when_simulated():
    args = paged([20], [4], Hk=1, G=2, D=16, block_size=4)
    with simulate_platform("gfx942"):
        reasons = dflash_rocm.explain("draft_attention", *args)
        assert reasons["rocm"] and "not in auto's order" in reasons["rocm"][0]
        dflash_rocm.reset_dispatch_counts()
        dflash_rocm.draft_attention(*args)
        assert ("draft_attention", "rocm") not in dflash_rocm.dispatch_counts()


def test_rocm_explains_why_it_cannot_run_here():
    args = paged([20], [4], Hk=1, G=2, D=16, block_size=4)
    reasons = dflash_rocm.explain("draft_attention", *args)["rocm"]
    assert "needs an AMD GPU with ROCm torch" in reasons[0]
    with simulate_platform("gfx90a"):
        reasons = dflash_rocm.explain("draft_attention", *args)["rocm"]
        assert "no launch table for gfx90a" in reasons[0]
