"""Platform detection: architecture names, families, wave sizes, simulation."""

import pytest
import torch

from dflash_rocm import platform
from dflash_rocm.arch import family_of


@pytest.mark.parametrize("name,arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx1100", "gfx1100"),
                                       ("GFX1201:xnack+", "gfx1201"), (" gfx950:sramecc+ ", "gfx950")])
def test_parse_gcn_arch_drops_feature_flags(name, arch):
    assert platform.parse_gcn_arch(name) == arch


def test_parse_gcn_arch_refuses_other_names():
    with pytest.raises(ValueError, match="not an AMD"):
        platform.parse_gcn_arch("sm_90")


@pytest.mark.parametrize("arch,family,wave", [("gfx942", "cdna", 64), ("gfx950", "cdna", 64), ("gfx90a", "cdna", 64),
                                              ("gfx1100", "rdna", 32), ("gfx1151", "rdna", 32),
                                              ("gfx1201", "rdna", 32), ("gfx1030", "rdna", 32),
                                              ("gfx940", "cdna", 64), ("sm_90", "nvidia", 32)])
def test_family_and_wave_size(arch, family, wave):
    p = platform.platform_for_arch(arch)
    assert (p.family, p.wave_size) == (family, wave)
    assert p.vendor == ("cuda" if family == "nvidia" else "rocm")


def test_lds_differs_between_cdna_and_rdna():
    assert platform.platform_for_arch("gfx942").lds_bytes == 64 * 1024
    assert platform.platform_for_arch("gfx1100").lds_bytes == 128 * 1024


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="unknown architecture"):
        family_of("tpu_v5")


def test_cpu_tensors_report_cpu_unless_simulated():
    assert platform.platform_for("cpu").vendor == "cpu"
    with platform.simulate_platform("gfx1100") as p:
        assert platform.platform_for(torch.device("cpu")) == p
        assert p.simulated and p.arch == "gfx1100" and p.family == "rdna"
        with platform.simulate_platform("gfx942"):
            assert platform.platform_for("cpu").arch == "gfx942"
        assert platform.platform_for("cpu").arch == "gfx1100"
    assert platform.platform_for("cpu") == platform.CPU_PLATFORM


def test_importing_probes_no_driver(monkeypatch):
    """Detection is lazy: nothing asks the GPU driver until a platform is requested."""
    import importlib
    import sys
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: calls.append(a))
    for name in [m for m in sys.modules if m.startswith("dflash_rocm")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.import_module("dflash_rocm")
    assert calls == []
