"""Configuration is data, not text: environment values reach compose.yaml's parsed strings and the systemd units
ops writes as values, never as YAML or unit syntax. A newline and an indent cannot add a key or a directive,
" #" and quotes are kept whole, and a line break where none can go is refused naming the variable. The real
compose.yaml, the real `ops` command, systemd-analyze, a shell and (where installed) docker-compose as judges."""

import shutil
import subprocess

import pytest
from ruamel.yaml import YAML

from ops.stack import StackError, load
from tests.backend.server_process import ROOT
from tests.ops.conftest import run_ops
from tests.ops.test_systemd import exec_words, parse

COMPOSE = ROOT / "compose.yaml"
INJECTED_KEY = "http://127.0.0.1:8188\n      SCRIPTORIUM_MCP_ALLOWED_DIRS: /"
INJECTED_DIRECTIVE = "http://127.0.0.1:8188\nExecStartPre=/bin/touch /tmp/pwned\n[Service]\nUser=root"
TOKEN = "s3cr #not-a-comment \"double\" 'single' \\back"


def environment_keys(stack) -> dict[str, set[str]]:
    return {name: set(s.environment) | set(s.native_env) for name, s in stack.services.items()}


def test_a_newline_and_indent_in_a_value_adds_no_key_and_is_kept_as_the_string():
    plain = load(COMPOSE, env={})
    injected = load(COMPOSE, env={"SCRIPTORIUM_COMFYUI_URL": INJECTED_KEY})
    assert environment_keys(injected) == environment_keys(plain)
    assert all("SCRIPTORIUM_MCP_ALLOWED_DIRS" not in keys for keys in environment_keys(injected).values())
    assert injected.services["mcp"].environment["SCRIPTORIUM_COMFYUI_URL"] == INJECTED_KEY


def test_hash_and_quotes_survive_whole():
    stack = load(COMPOSE, env={"SCRIPTORIUM_MCP_TOKEN": TOKEN, "SCRIPTORIUM_MODEL": "/models/{0} {odd #x"})
    assert stack.services["mcp"].environment["SCRIPTORIUM_MCP_TOKEN"] == TOKEN
    native = stack.services["backend"].native
    assert native[native.index("--model") + 1] == "/models/{0} {odd #x"  # braces are not a format template


@pytest.mark.parametrize("variable,value", [
    ("SCRIPTORIUM_BACKEND_PORT", "8000\n    privileged: true"),  # ports, health URL and x-ops.port
    ("SCRIPTORIUM_MODEL", "smollm2\n      - --trust-remote-code"),  # a command-line argument
    ("SCRIPTORIUM_IMAGE", "scriptorium:latest\r"),  # an image name: a carriage return is a line break too
])
def test_a_line_break_where_none_can_go_is_refused_naming_the_variable(tmp_path, variable, value):
    with pytest.raises(StackError, match=variable):
        load(COMPOSE, env={variable: value})
    result = run_ops(tmp_path, "plan", env={"SCRIPTORIUM_COMPOSE": str(COMPOSE), variable: value})
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and variable in lines[0] and "line break" in lines[0]
    assert "Traceback" not in result.stderr


def test_the_dot_env_file_keeps_inner_quotes_and_hashes_within_quotes(tmp_path):
    shutil.copy(COMPOSE, tmp_path / "compose.yaml")
    shutil.copytree(ROOT / "engines", tmp_path / "engines")
    (tmp_path / ".env").write_text('SCRIPTORIUM_MCP_TOKEN=ab"c #d\nSCRIPTORIUM_COMFYUI_URL="http://h:1/#x"\n')
    mcp = load(tmp_path / "compose.yaml", env={}).services["mcp"].environment
    # a quote inside an unquoted value is the value's own, and " #" begins a comment there, as Compose reads it
    # (docker-compose config gives ab"c)
    assert mcp["SCRIPTORIUM_MCP_TOKEN"] == 'ab"c'
    assert mcp["SCRIPTORIUM_COMFYUI_URL"] == "http://h:1/#x"  # one pair of enclosing quotes is removed


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_ops_and_docker_compose_read_the_same_values():
    """Compose itself substitutes into the parsed file: its rendering, parsed again, matches what ops sees."""
    env = {"SCRIPTORIUM_COMFYUI_URL": INJECTED_KEY, "SCRIPTORIUM_MCP_TOKEN": TOKEN}
    rendered = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                              cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env}, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    theirs = YAML(typ="safe").load(rendered.stdout)["services"]["mcp"]["environment"]
    ours = load(COMPOSE, env=env).services["mcp"].environment
    assert theirs["SCRIPTORIUM_COMFYUI_URL"] == ours["SCRIPTORIUM_COMFYUI_URL"] == INJECTED_KEY
    assert theirs["SCRIPTORIUM_MCP_TOKEN"] == ours["SCRIPTORIUM_MCP_TOKEN"] == TOKEN
    assert set(theirs) == set(ours)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("runner", ["process", "docker"])
def test_a_newline_in_a_value_adds_no_directive_to_the_units_and_the_env_file_keeps_it_whole(tmp_path, runner):
    home, out = tmp_path / "home", tmp_path / "units"
    env = {"SCRIPTORIUM_COMPOSE": str(COMPOSE), "SCRIPTORIUM_COMFYUI_URL": INJECTED_DIRECTIVE,
           "SCRIPTORIUM_MCP_TOKEN": TOKEN + "\nExecStartPre=/bin/touch /tmp/pwned"}
    result = run_ops(home, "systemd", "print", "--output", str(out), "--runner", runner, env=env)
    assert result.returncode == 0, result.stderr
    verify = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in out.iterdir())],
                            capture_output=True, text=True, cwd=out)
    assert verify.returncode == 0, verify.stderr
    for unit in out.glob("*.service"):
        text = unit.read_text()
        assert "\nExecStartPre=/bin/touch" not in text and "\nUser=" not in text, unit.name
        assert text.splitlines().count("[Service]") == 1, unit.name
    assert set(parse(out / "scriptorium-health.service")["Service"]) <= {"Type", "Environment", "EnvironmentFile",
                                                                         "ExecStart"}
    values = [exec_words(line.removeprefix("Environment="))[0]
              for line in (out / "scriptorium-health.service").read_text().splitlines() if line.startswith("Environment=")]
    assert f"SCRIPTORIUM_COMFYUI_URL={INJECTED_DIRECTIVE}" in values
    # The environment file (mode 0600) read back by a shell, as systemd reads it: the token whole, one variable.
    env_file = home / "state" / "systemd.env"
    read = subprocess.run(["sh", "-c", f'set -a; . "{env_file}"; printf %s "$SCRIPTORIUM_MCP_TOKEN"'],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert read.returncode == 0 and read.stdout == TOKEN + "\nExecStartPre=/bin/touch /tmp/pwned"
