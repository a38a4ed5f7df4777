"""Environment variables: one parser for switches, refusals that name the variable and
the accepted values, a log level that cannot break the import, TRITON_INTERPRET read
as Triton reads it, and ``info`` showing what is invalid instead of failing."""

import os
import subprocess
import sys
import types

import pytest

from dflash_rocm import envs
from dflash_rocm.info import environment_entry
from dflash_rocm.platform import platform_for_arch

SWITCH_WORDS = {True: ["1", "true", "True", "ON", "yes", " on "], False: ["0", "false", "OFF", "No", " off\t"]}


@pytest.mark.parametrize("expected,word", [(v, w) for v, words in SWITCH_WORDS.items() for w in words])
def test_every_switch_spelling_is_understood(expected, word):
    assert envs.parse_switch("X", word) is expected
    assert envs.parse_switch("X", word, modes=("auto",)) is expected
    assert envs.parse_switch("X", " Auto ", modes=("auto",)) == "auto"


@pytest.mark.parametrize("var,value", [(envs.TUNE, "maybe"), (envs.AITER, "2"), (envs.VLLM, "auto"),
                                       (envs.VLLM, "enabled")])
def test_an_unknown_switch_value_is_refused_with_the_name_and_the_accepted_values(var, value, monkeypatch):
    monkeypatch.setenv(var.name, value)
    with pytest.raises(ValueError, match=rf"{var.name}='{value}': expected one of .*true.*off"):
        var.value()
    assert var.name in var.problem()


@pytest.fixture(autouse=True)
def _warn_again():
    """Each test sees its own once-per-variable warning."""
    envs._warned.clear()
    yield
    envs._warned.clear()


@pytest.mark.parametrize("word", ["false", "off", "no", "OFF", "0"])
def test_aiter_off_in_any_spelling_disables_aiter(word, monkeypatch):
    from dflash_rocm.backends.aiter import attention as aiter_attention

    monkeypatch.setenv("DFLASH_ROCM_AITER", word)
    aiter_attention.installed.cache_clear()
    try:
        features, why = aiter_attention.probe(envs.AITER.setting())
    finally:
        aiter_attention.installed.cache_clear()
    assert features is None and "disabled" in why and "DFLASH_ROCM_AITER" in why


def test_a_bad_aiter_value_is_refused_with_one_warning_and_reported_by_info(monkeypatch, caplog):
    """Refused where a call reads it: one warning naming the variable and what it accepts,
    and the default (auto) applies; no call fails over it. ``info`` shows it invalid."""
    from dflash_rocm.backends.aiter import attention as aiter_attention

    monkeypatch.setenv("DFLASH_ROCM_AITER", "sometimes")
    aiter_attention.installed.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="dflash_rocm"):
            features, why = aiter_attention.probe(envs.AITER.setting())
            aiter_attention.installed.cache_clear()
            aiter_attention.probe(envs.AITER.setting())
    finally:
        aiter_attention.installed.cache_clear()
    assert "disabled" not in why  # the default, auto: here aiter is simply not installed
    warnings = [r.getMessage() for r in caplog.records if "DFLASH_ROCM_AITER" in r.getMessage()]
    assert len(warnings) == 1 and "expected one of auto, 1, true" in warnings[0] and "default 'auto'" in warnings[0]
    entry = environment_entry(envs.AITER)
    assert entry["value"] == "sometimes" and not entry["valid"] and "expected one of" in entry["problem"]


@pytest.mark.parametrize("word", ["false", "off", "no", "0"])
def test_vllm_off_in_any_spelling_leaves_vllm_untouched(word, monkeypatch):
    from dflash_rocm import vllm_plugin

    registered = []
    fake = types.ModuleType("vllm")
    fake.ModelRegistry = types.SimpleNamespace(register_model=lambda *a: registered.append(a))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("DFLASH_ROCM_VLLM", word)
    monkeypatch.setattr(vllm_plugin, "_originals", {})
    vllm_plugin.register()
    assert registered == [] and not vllm_plugin._originals
    assert f"DFLASH_ROCM_VLLM={word}" in vllm_plugin.plugin_status()["reasons"]


@pytest.mark.parametrize("name,value", [("DFLASH_ROCM_VLLM", "maybe"), ("DFLASH_ROCM_BACKEND", "cdua")])
def test_the_plugin_refuses_a_bad_value_of_either_variable_that_decides_what_runs(name, value, monkeypatch):
    """One rule for both (README): refused, naming the variable, when vLLM loads the plugin and
    before anything is registered: one error line, the plugin steps aside (no traceback through
    vLLM's loader); plugin_status gives the same reason."""
    from dflash_rocm import vllm_plugin

    registered, records = [], []
    fake = types.ModuleType("vllm")
    fake.ModelRegistry = types.SimpleNamespace(register_model=lambda *a: registered.append(a))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(vllm_plugin, "_originals", {})
    monkeypatch.setattr(vllm_plugin.logger, "handle", records.append)
    vllm_plugin.register()
    assert registered == [] and not vllm_plugin._originals
    assert [r.levelname for r in records] == ["ERROR"]
    assert f"{name}={value!r}: " in records[0].getMessage() and "\n" not in records[0].getMessage()
    assert any(r.startswith(f"{name}={value!r}") for r in vllm_plugin.plugin_status()["reasons"])


@pytest.mark.parametrize("word,rdna_auto", [("true", True), ("on", True), ("off", False), ("no", False)])
def test_tune_takes_every_switch_spelling(word, rdna_auto, monkeypatch):
    from dflash_rocm.backends.rocm import settings

    monkeypatch.setenv("DFLASH_ROCM_TUNE", word)
    assert settings.tuning_enabled(platform_for_arch("gfx942")) is rdna_auto
    monkeypatch.setenv("DFLASH_ROCM_TUNE", "AUTO")
    assert settings.tuning_enabled(platform_for_arch("gfx1100")) is True
    assert settings.tuning_enabled(platform_for_arch("gfx942")) is False


@pytest.mark.parametrize("value", ["0", "-4", "sixteen", "1.5"])
def test_a_bad_query_limit_is_refused_with_its_name(value, monkeypatch, caplog):
    from dflash_rocm.backends.rocm import settings

    monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", value)
    with pytest.raises(ValueError, match=f"DFLASH_ROCM_QUERY_LIMIT='{value}': expected a positive integer"):
        envs.QUERY_LIMIT.value()
    with caplog.at_level("WARNING", logger="dflash_rocm"):
        assert settings.query_limit() == settings.current().query_limit  # the configured limit applies
    assert f"DFLASH_ROCM_QUERY_LIMIT='{value}'" in caplog.text
    monkeypatch.setenv("DFLASH_ROCM_QUERY_LIMIT", " 17 ")
    assert settings.query_limit() == 17


@pytest.mark.parametrize("value,level", [("debug", 10), ("Info", 20), ("WARNING", 30), ("40", 40)])
def test_log_levels_by_name_in_any_case_or_number(value, level, monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_LOG_LEVEL", value)
    assert envs.LOG_LEVEL.value() == level


def test_a_bad_log_level_warns_once_and_never_breaks_the_import():
    env = dict(os.environ, DFLASH_ROCM_LOG_LEVEL="basic_format")
    result = subprocess.run(
        [sys.executable, "-c", "import logging, dflash_rocm; print(logging.getLogger('dflash_rocm').level)"],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "30"
    warned = [line for line in result.stderr.splitlines() if "DFLASH_ROCM_LOG_LEVEL" in line]
    assert len(warned) == 1 and "basic_format" in warned[0] and "keeping WARNING" in warned[0]


TRITON_VALUES = ["1", "0", "true", "TRUE", "on", "yes", "y", "Y", "t", "false", "off", "no", " 1", "1 ", "2",
                 "junk", ""]


@pytest.mark.parametrize("value", TRITON_VALUES)
def test_triton_interpret_is_read_exactly_as_triton_reads_it(value, monkeypatch):
    pytest.importorskip("triton")
    from triton._C.libtriton import getenv_bool  # what triton.knobs.runtime.interpret calls

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert envs.TRITON_INTERPRET.value() is getenv_bool("TRITON_INTERPRET", False)
    if value in ("true", "TRUE", "on", "yes"):
        assert envs.TRITON_INTERPRET.value()


@pytest.mark.parametrize("value,valid", [("true", True), ("0", True), (" 1", False), ("junk", False)])
def test_info_flags_triton_interpret_values_triton_reads_as_off(value, valid, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    entry = environment_entry(envs.TRITON_INTERPRET)
    assert entry["valid"] is valid
    assert valid or "Triton reads it as off" in entry["problem"]
