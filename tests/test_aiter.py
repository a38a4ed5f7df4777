"""aiter support without ROCm: the run-time probe, the reasons, the argument mapping (against
a stand-in implementing CK's documented varlen semantics) and the first-call check."""

import logging
import sys

import pytest
import torch

import dflash_rocm
from dflash_rocm import envs
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.backends.aiter import AiterAttention, AiterBackend
from dflash_rocm.backends.aiter import attention as aiter_attention
from dflash_rocm.platform import platform_for_arch
from dflash_rocm.ops.attention import reference as reference_attention
from dflash_rocm.ops.attention import attention_call
from test_triton_backend import paged

CK_STANDIN = '''
import torch

calls = []
WRONG = False


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                           dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                           window_size=(-1, -1), block_table=None, out=None{sink}):
    """CK varlen semantics: bottom-right aligned causal; window (left, right) around the
    bottom-right aligned diagonal; key counts from cu_seqlens_k; pages from block_table."""
    calls.append(dict(causal=causal, window_size=window_size))
    bs, group = k.shape[1], q.shape[1] // k.shape[2]
    sink = locals().get("sink_ptr")
    for b in range(block_table.shape[0]):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        sk = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        sq = q1 - q0
        if sq == 0:
            continue
        j = torch.arange(sk)
        keys = k[block_table[b, j // bs].long(), j % bs].float().repeat_interleave(group, 1)
        vals = v[block_table[b, j // bs].long(), j % bs].float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * softmax_scale
        diag = torch.arange(sq)[:, None] + sk - sq
        keep = torch.ones(sq, sk, dtype=torch.bool)
        left, right = window_size
        if causal:
            right = 0
        if left >= 0:
            keep &= j[None] >= diag - left
        if right >= 0:
            keep &= j[None] <= diag + right
        s = s.masked_fill(~keep, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.view(-1, 1, 1).expand(-1, sq, 1)], -1)
        p = torch.softmax(s, -1)[..., :sk]
        o = torch.einsum("hqk,khd->qhd", p, vals)
        out[q0:q1] = (o * (2.0 if WRONG else 1.0)).to(out.dtype)
    return out
'''


@pytest.fixture
def fake_aiter(tmp_path, monkeypatch):
    """Install a stand-in ``aiter`` package; ``make(sinks=True)`` picks its signature."""
    def make(sinks=True, body=None):
        pkg = tmp_path / f"site{len(list(tmp_path.iterdir()))}" / "aiter"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(body or CK_STANDIN.format(sink=", sink_ptr=None" if sinks else ""))
        monkeypatch.syspath_prepend(str(pkg.parent))
        for name in [m for m in list(sys.modules) if m == "aiter" or m.startswith("aiter.")]:
            monkeypatch.delitem(sys.modules, name)
        aiter_attention.installed.cache_clear()
        aiter_attention._verified.clear()
        try:
            return __import__("aiter")
        except RuntimeError:
            return None
    yield make
    for name in [m for m in list(sys.modules) if m == "aiter" or m.startswith("aiter.")]:
        del sys.modules[name]  # an imported stand-in must not outlive its test
    aiter_attention.installed.cache_clear()
    aiter_attention._verified.clear()


def test_probe_without_aiter_says_so(monkeypatch):
    monkeypatch.setattr(aiter_attention.importlib.util, "find_spec", lambda name: None)
    aiter_attention.installed.cache_clear()
    features, why = aiter_attention.probe(envs.AITER.setting())
    aiter_attention.installed.cache_clear()
    assert features is None and "not installed" in why and "amd-aiter" in why


def test_probe_survives_an_aiter_that_raises_without_rocm(fake_aiter):
    fake_aiter(body="raise RuntimeError('no ROCm device found')\n")
    features, why = aiter_attention.probe(envs.AITER.setting())
    assert features is None and "RuntimeError" in why and "no ROCm device" in why


def test_probe_reads_features_from_the_signature(fake_aiter):
    fake_aiter(sinks=False)
    features, why = aiter_attention.probe(envs.AITER.setting())
    assert why is None and features.block_table and not features.sinks


def test_probe_can_be_switched_off(fake_aiter, monkeypatch):
    fake_aiter()
    monkeypatch.setenv("DFLASH_ROCM_AITER", "0")
    aiter_attention.installed.cache_clear()
    assert "disabled" in aiter_attention.probe(envs.AITER.setting())[1]


def paged_call(block_size=128, **kwargs):
    args = paged([300, 150], [16, 16], Hk=2, G=4, D=64, block_size=block_size, dtype=torch.bfloat16)
    return attention_call(*args, **kwargs)


def test_reasons_name_every_limit(fake_aiter):
    fake_aiter(sinks=False)
    cdna, rdna = platform_for_arch("gfx942"), platform_for_arch("gfx1100")
    features, _ = aiter_attention.installed()
    assert aiter_attention.platform_reasons(cdna, "auto") == [] and aiter_attention.call_reasons(paged_call(),
                                                                                                 features) == []
    assert any("targets CDNA" in r for r in aiter_attention.platform_reasons(rdna, "auto"))
    assert any("multiple of 128" in r for r in aiter_attention.call_reasons(paged_call(block_size=16), features))
    assert any("no sinks" in r for r in aiter_attention.call_reasons(paged_call(sinks=torch.zeros(8)), features))


def test_the_backend_reports_the_probe_and_implements_attention_only(fake_aiter):
    fake_aiter()
    reasons = dflash_rocm.explain("draft_attention", *paged([40], [4], Hk=2, G=4, D=64, block_size=128,
                                                            dtype=torch.bfloat16))["aiter"]
    assert reasons == ["aiter runs on GPU tensors only (tensors on cpu)"] or "targets CDNA" in reasons[0]
    assert "usable" in AiterBackend.status()["aiter"]
    assert AiterBackend.implementation(ATTENTION) is not None and AiterBackend.implementation(PRECOMPUTE) is None


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(sliding_window=40),
                                    dict(sliding_window=7, causal=True), dict(sinks=torch.linspace(-2, 2, 8))],
                         ids=["non-causal", "causal", "window", "causal-window", "sinks"])
def test_argument_mapping_computes_the_spec(fake_aiter, kwargs):
    module = fake_aiter()
    call = paged_call(**kwargs)
    ref_call = paged_call(**kwargs)
    reference_attention(ref_call)
    aiter_attention.run(call, aiter_attention.installed()[0], fallback=lambda c: reference_attention(c))
    aiter_attention.run(call, aiter_attention.installed()[0], fallback=lambda c: reference_attention(c))
    assert len(module.calls) == 2  # verified once, then trusted
    assert dflash_rocm.contract.relative_error(call.out, ref_call.out) < 2e-2


def test_a_disagreeing_aiter_is_disabled_for_that_signature(fake_aiter, caplog):
    module = fake_aiter()
    module.WRONG = True
    call, ref_call = paged_call(), paged_call()
    reference_attention(ref_call)
    with caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        aiter_attention.run(call, aiter_attention.installed()[0], fallback=lambda c: reference_attention(c))
    assert "disagrees" in caplog.text
    assert dflash_rocm.contract.relative_error(call.out, ref_call.out) < 2e-2  # the fallback's result stands
    aiter_attention.run(call, aiter_attention.installed()[0], fallback=lambda c: reference_attention(c))
    assert len(module.calls) == 1


def test_no_first_call_check_runs_while_a_graph_is_captured(fake_aiter, monkeypatch, caplog):
    """The check reads its comparison back to the host, which a capture forbids: an
    unchecked signature is served by the fallback in the graph (said once), checked at its
    first eager call, and aiter serves the graphs captured after that."""
    from dflash_rocm import capture

    module = fake_aiter()
    monkeypatch.setattr(aiter_attention, "_captured_unchecked", set())
    call, ref_call = paged_call(), paged_call()
    reference_attention(ref_call)
    fallbacks = []

    def fallback(c):
        fallbacks.append(1)
        reference_attention(c)

    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="dflash_rocm"):
        m.setattr(capture, "graph_capturing", lambda device: True)
        aiter_attention.run(call, aiter_attention.installed()[0], fallback)
        aiter_attention.run(call, aiter_attention.installed()[0], fallback)
    assert module.calls == [] and len(fallbacks) == 2 and caplog.text.count("cannot run while a CUDA graph") == 1
    assert dflash_rocm.contract.relative_error(call.out, ref_call.out) < 2e-2
    aiter_attention.run(call, aiter_attention.installed()[0], fallback)  # eager: aiter, checked against the fallback
    assert len(module.calls) == 1 and len(fallbacks) == 3
    with monkeypatch.context() as m:
        m.setattr(capture, "graph_capturing", lambda device: True)
        aiter_attention.run(call, aiter_attention.installed()[0], fallback)
    assert len(module.calls) == 2 and len(fallbacks) == 3


def test_packed_pages_are_refused_for_the_triton_kernel(fake_aiter, monkeypatch):
    """vLLM ROCM_ATTN's packed pages (a ``PackedCache``, what the plugin hands over on
    MI300X) are no tensor CK's paged kernel can read: aiter refuses them (on a GPU, here
    pretended: no device reasons), so ``auto`` moves on to the rocm backend, which reads
    them in place."""
    from strategies import pack_caches

    fake_aiter()
    monkeypatch.setattr(AiterBackend, "device_not_supported_reasons", classmethod(lambda cls, device, platform: []))
    query, key_cache, value_cache, *rest = paged([300, 150], [16, 16], Hk=2, G=4, D=64, block_size=128,
                                                 dtype=torch.bfloat16)
    call = attention_call(query, *pack_caches(key_cache, value_cache, "rocm_attn"), *rest)
    reasons = AiterAttention.not_supported_reasons(call, platform_for_arch("gfx942"))
    assert any("packed cache pages" in r for r in reasons), reasons
