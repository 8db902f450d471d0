"""Every EngineConfig field reaches the engine from each front door (`serve`'s flags, `generate`'s flags,
EngineArgs) with the default, type and help config.py gives it, and a field added there shows up at each door
with no other edit."""

import json
import shutil
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from backend.__main__ import GENERATE_OWN, build_parser
from backend.config import EngineConfig
from backend.config_flags import engine_settings, flag_name
from backend.engine_args import EngineArgs
from backend.server import serve
from backend.server.serve_flags import SERVE_OWN

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [f for f in fields(EngineConfig) if f.default is not MISSING]


def subparser(command: str):
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices[command]


@pytest.mark.parametrize("command, own", [("serve", SERVE_OWN), ("generate", GENERATE_OWN)])
def test_each_setting_is_a_flag_of_serve_and_generate_with_its_default_and_help(command, own):
    actions = {a.dest: a for a in subparser(command)._actions}
    for setting in fields(EngineConfig):
        assert setting.name in actions, f"{command} has no flag for EngineConfig.{setting.name}"
        action = actions[setting.name]
        if setting.name in own:
            continue  # declared by the front door itself, with a meaning of its own
        assert flag_name(setting) in action.option_strings
        assert action.default == setting.default, setting.name
        assert setting.metadata["help"] in action.help, setting.name


def test_serve_and_generate_with_no_flags_make_the_default_config():
    serve_args = build_parser().parse_args(["serve"])
    assert serve._engine_config(serve_args, "m", serve_args.gpu_memory_utilization) == EngineConfig(model="m")
    generate_args = build_parser().parse_args(["generate", "a prompt"])
    made = EngineConfig(model=generate_args.model, **engine_settings(generate_args, GENERATE_OWN))
    assert made == EngineConfig(model="smollm2")


def test_flags_missing_before_reach_the_engine_from_both_commands():
    given = [
        "--tokenizer",
        "/tok",
        "--num-kv-blocks",
        "40",
        "--kv-cache-memory",
        "2e9",
        "--no-prefix-caching",
        "--speculative",
        '{"method": "ngram"}',
        "--enforce-eager",
        "--max-schema-bytes",
        "1000",
    ]
    expected = {
        "tokenizer": "/tok",
        "num_kv_blocks": 40,
        "kv_cache_memory": 2_000_000_000,
        "enable_prefix_caching": False,
        "speculative": '{"method": "ngram"}',
        "enforce_eager": True,
        "max_schema_bytes": 1000,
    }
    serve_args = build_parser().parse_args(["serve", *given])
    config = serve._engine_config(serve_args, "m", 0.9)
    assert {name: getattr(config, name) for name in expected} == expected
    generate_args = build_parser().parse_args(["generate", "a prompt", "--seed", "5", *given])
    settings = engine_settings(generate_args, GENERATE_OWN)
    assert {name: settings[name] for name in expected} == expected
    # generate's --seed is its request's; the engine's own seed keeps its default
    assert (
        generate_args.seed == 5 and EngineConfig(model="m", **settings).seed == EngineConfig(model="m").seed
    )


def test_serve_refuses_one_tokenizer_for_several_models():
    args = build_parser().parse_args(["serve", "--model", "a", "--model", "b", "--tokenizer", "/tok"])
    with pytest.raises(ValueError, match="--tokenizer is the tokenizer of a single --model"):
        serve.serve(args)


def test_each_setting_is_an_engine_args_field_with_its_default():
    args_fields = {f.name: f for f in fields(EngineArgs)}
    for setting in SETTINGS:
        assert setting.name in args_fields, f"EngineArgs has no field {setting.name}"
        assert args_fields[setting.name].default == setting.default, setting.name
    assert EngineArgs(model="m").create_engine_config() == EngineConfig(model="m")
    made = EngineArgs(
        model="m", num_kv_blocks=40, speculative={"method": "ngram"}, max_n=2
    ).create_engine_config()
    assert (made.num_kv_blocks, made.speculative, made.max_n) == (40, {"method": "ngram"}, 2)
    with pytest.raises(ValueError, match="speculative_model and speculative both"):
        EngineArgs(model="m", speculative_model="d", speculative={"method": "ngram"}).create_engine_config()


ADDED = """    added_setting: int = setting(7, "a setting the test adds")

    def __post_init__(self) -> None:"""

CHECK = """
import json
from backend.__main__ import GENERATE_OWN, build_parser
from backend.config_flags import engine_settings
from backend.engine_args import EngineArgs
from backend.server import serve
parser = build_parser()
commands = next(a for a in parser._actions if a.dest == "command")
serve_args = parser.parse_args(["serve", "--added-setting", "9"])
generate_args = parser.parse_args(["generate", "p", "--added-setting", "4"])
print(json.dumps({
    "serve": serve._engine_config(serve_args, "m", 0.9).added_setting,
    "serve_default": parser.parse_args(["serve"]).added_setting,
    "generate": engine_settings(generate_args, GENERATE_OWN)["added_setting"],
    "engine_args_default": EngineArgs(model="m").added_setting,
    "engine_args": EngineArgs(model="m", added_setting=3).create_engine_config().added_setting,
    "help": next(a.help for a in commands.choices["serve"]._actions if a.dest == "added_setting"),
}))
"""


def test_a_field_added_to_engine_config_reaches_every_front_door(tmp_path):
    """A copy of the package with one field added to config.py, and nothing else changed."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build")
    for package in ("backend", "common"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    config = tmp_path / "backend" / "config.py"
    source = config.read_text()
    assert source.count("\n    def __post_init__(self) -> None:") == 1
    config.write_text(source.replace("    def __post_init__(self) -> None:", ADDED))
    out = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "serve": 9,
        "serve_default": 7,
        "generate": 4,
        "engine_args_default": 7,
        "engine_args": 3,
        "help": "a setting the test adds",
    }
