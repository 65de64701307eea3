"""Mesh configuration: one source of engine defaults, range checks naming the variable, strict
parsing, and every engine setting reachable from `evenflow up` flags."""

from __future__ import annotations

import dataclasses

import pytest

from evenflow.cli import _mesh_settings, build_parser
from evenflow.engine.config.settings import EngineConfig
from evenflow.services.config import ConfigError, MeshConfig, load_mesh_config


def test_the_mesh_runs_the_engine_defaults():
    engine, mesh = EngineConfig(), MeshConfig().engine_config()
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("num_threads", "num_ep_ranks", "num_redundant_experts"):
            assert getattr(mesh, f.name) == getattr(engine, f.name), f.name
    assert mesh.num_threads == 1  # one thread per worker: several share a small machine


@pytest.mark.parametrize(("env", "message"), [
    ({"EVENFLOW_KV_OVERLAP_WEIGHT": "-5"}, r"\(EVENFLOW_KV_OVERLAP_WEIGHT\) must be >= 0"),
    ({"EVENFLOW_WORKER_TIMEOUT_S": "0"}, r"\(EVENFLOW_WORKER_TIMEOUT_S\) must be > 0"),
    ({"EVENFLOW_EPLB_THRESHOLD": "1.5"}, "<= 1"),
    ({"EVENFLOW_PORT": "70000"}, "EVENFLOW_PORT"),
    ({"EVENFLOW_ROUTER": "fastest"}, "must be one of kv, least_load, round_robin"),
    ({"EVENFLOW_KV_CACHE_GB": "0"}, r"kv_cache_gb \(EVENFLOW_KV_CACHE_GB\) must be > 0"),
    ({"EVENFLOW_DTYPE": "int3"}, r"dtype \(EVENFLOW_DTYPE\) must be one of auto, float32"),
    ({"EVENFLOW_NUM_KV_BLOCKS": "0"}, r"\(EVENFLOW_NUM_KV_BLOCKS\) must be >= 1"),
    ({"EVENFLOW_MAX_NUM_SEQS": "abc"}, "cannot parse 'abc' as int"),
    ({"EVENFLOW_ENABLE_TURBO": "1"}, "unknown setting EVENFLOW_ENABLE_TURBO"),
    ({"EVENFLOW_QUANTIZATION": "int3"}, "quantization"),
    ({"EVENFLOW_QUANTIZATION": "int4", "EVENFLOW_QUANT_GROUP_SIZE": "48"}, "group size"),
    ({"EVENFLOW_BUS_PEER_REASSEMBLY_MB": "0"}, "EVENFLOW_BUS_PEER_REASSEMBLY_MB"),
])
def test_bad_settings_are_refused_with_the_variable_named(env, message):
    with pytest.raises(ConfigError, match=message):
        load_mesh_config(environ=env)


def test_values_parse_by_their_type():
    config = load_mesh_config(environ={"EVENFLOW_NATS_URL": "nats://x:1",
                                  "EVENFLOW_API_KEYS": "a,b", "EVENFLOW_ROUTER_TEMPERATURE": "2"})
    assert config.nats_url == "nats://x:1" and config.api_keys == ("a", "b")
    assert config.router_temperature == 2.0


def test_up_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "up", "--dtype", "float32", "--threads", "2", "--kv-cache-gb", "0.25",
        "--max-num-seqs", "8", "--max-model-len", "512", "--router", "least_load",
        "--log-level", "debug", "--num-kv-blocks", "100"])
    config = load_mesh_config(_mesh_settings(args), environ={})
    engine = config.engine_config()
    assert (engine.dtype, engine.num_threads, engine.kv_cache_gb, engine.max_num_seqs,
            engine.max_model_len, engine.num_kv_blocks) == ("float32", 2, 0.25, 8, 512, 100)
    assert config.router == "least_load" and config.log_level == "debug"


def test_quantization_reaches_the_engine_and_the_bus_budget_the_bus():
    args = build_parser().parse_args(["up", "--quantization", "int4", "--quant-group-size", "32"])
    config = load_mesh_config(_mesh_settings(args),
                              environ={"EVENFLOW_BUS_PEER_REASSEMBLY_MB": "8"})
    engine = config.engine_config()
    assert (engine.quantization, engine.quant_group_size) == ("int4", 32)
    assert load_mesh_config(environ={}).engine_config().quantization is None
    assert config.reassembly_budget().peer_bytes == 8 * 2**20


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("evenflow ")


def test_engine_switches_reach_every_worker_as_their_own_variables():
    cfg = load_mesh_config(environ={"EVENFLOW_NATIVE_PREFILL_ATTENTION": "0",
                               "EVENFLOW_FAST_DECODE": "off"})
    assert cfg.switch_values() == {"EVENFLOW_FAST_DECODE": "off",
                                   "EVENFLOW_NATIVE_PREFILL_ATTENTION": "0"}
    env = cfg.to_env()
    assert env["EVENFLOW_NATIVE_PREFILL_ATTENTION"] == "0" and "EVENFLOW_ENGINE_SWITCHES" not in env
    assert load_mesh_config(environ=env) == cfg  # a child process rebuilds the same config
    # Ray Serve's application args name them without the prefix
    assert load_mesh_config({"native_prefill_attention": "0", "fast_decode": "off"}) == cfg


@pytest.mark.parametrize("env, message", [
    ({"EVENFLOW_NATIVE_NORM": "maybe"}, "EVENFLOW_NATIVE_NORM must be 1 or 0"),
    ({"EVENFLOW_NATIVE_NROM": "0"}, "unknown setting EVENFLOW_NATIVE_NROM"),
])
def test_a_bad_engine_switch_is_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        load_mesh_config(environ=env)


def test_help_env_lists_the_mesh_settings_and_the_engine_switches(capsys):
    from evenflow.cli import main
    from evenflow.engine.config.settings import ENGINE_SWITCHES

    assert main(["up", "--help-env"]) == 0
    out = capsys.readouterr().out
    assert "EVENFLOW_DRAIN_TIMEOUT_S=" in out
    assert all(f"{name}=" in out for name in ENGINE_SWITCHES)


def test_every_setting_is_declared_once_with_its_help():
    """EngineConfig's settings reach the mesh by inheritance (no second declaration), and each
    setting of both has its help; the flags name real settings."""
    from evenflow.engine.config.fields import settings_of

    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    mesh = [f.name for f in dataclasses.fields(MeshConfig)]
    assert engine <= set(mesh) and len(mesh) == len(set(mesh))
    declared = settings_of(MeshConfig)
    assert [f.name for f, _ in declared] == mesh  # every field is a setting
    assert all(s.help for _, s in declared)


def test_an_unset_optional_setting_stays_unset_from_the_environment():
    config = load_mesh_config(environ={"EVENFLOW_NUM_KV_BLOCKS": "", "EVENFLOW_QUANTIZATION": ""})
    assert config.num_kv_blocks is None and config.quantization is None
    assert load_mesh_config(environ=config.to_env()) == config


def test_serve_has_its_own_flags_and_generate_the_engines():
    parser = build_parser()
    serve = parser.parse_args(["serve", "--roles", "decode", "--ep", "2", "--ep-ranks", "1",
                               "--ep-rendezvous", "h:1", "--no-deterministic"])
    assert _mesh_settings(serve) == {"expert_parallel_size": 2, "ep_ranks": "1",
                                     "ep_rendezvous": "h:1", "deterministic": False}
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--ep-ranks", "1"])  # serve's alone
    gen = parser.parse_args(["generate", "hi", "--threads", "2", "--kv-cache-dtype", "int8"])
    from evenflow.engine.config.fields import flag_values

    assert flag_values(gen, gen.setting_flags) == {"num_threads": 2, "kv_cache_dtype": "int8"}


def test_docs_configuration_table_is_current():
    """docs/configuration.md is generated from the declarations: `python -m
    evenflow.ops.settings_doc` rewrites it."""
    from pathlib import Path

    from evenflow.ops.settings_doc import render

    path = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert path.read_text() == render(), "run `python -m evenflow.ops.settings_doc`"


def test_lora_modules_and_the_agent_flags_reach_the_mesh_config():
    args = build_parser().parse_args([
        "up", "--lora-modules", "a=/adapters/a", "b=/adapters/b", "--max-loras", "2",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    config = load_mesh_config(_mesh_settings(args), environ={})
    assert config.lora_modules == ("a=/adapters/a", "b=/adapters/b")
    assert config.engine_config().max_loras == 2
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    # and through the environment, as the launcher passes them on
    again = load_mesh_config(environ=config.to_env())
    assert again.lora_modules == config.lora_modules and again.max_loras == 2
