"""The project's .env as Compose reads it (cross-checked with the real `docker compose config`), and values from the
environment or .env kept as data: never read for ops' {python}, {port} and {home} placeholders."""

import os
import shutil
import subprocess
import sys

import pytest
from ruamel.yaml import YAML

from ops.stack import StackError, load

# Lines every Compose reads alike (v1's python-dotenv and v2's compose-go): comments, export, quotes, escapes.
TRICKY_ENV = r"""# a full-line comment
   # an indented comment

PORT=8123 # my port
HASH=abc#def
export EXPORTED=yes
SPACED =  padded value
SINGLE='literal $PORT \n # kept'
SINGLE_ESCAPED='it\'s'
DOUBLE="tab\there \"quoted\" back\\slash # kept"
DOUBLE_REF="port ${PORT}"
MULTILINE="line one
line two"
EMPTY=
EMPTY_QUOTED=""
REF=${PORT}-x
REF_DEFAULT=${NOPE:-fallback}
TRAILING="kept" # a comment
BRACES=x{home}y{python}
FROM_ENV=from the file
"""
NAMES = [
    "PORT",
    "HASH",
    "EXPORTED",
    "SPACED",
    "SINGLE",
    "SINGLE_ESCAPED",
    "DOUBLE",
    "DOUBLE_REF",
    "MULTILINE",
    "EMPTY",
    "EMPTY_QUOTED",
    "REF",
    "REF_DEFAULT",
    "TRAILING",
    "BRACES",
    "FROM_ENV",
]
ENVIRON = {"FROM_ENV": "from the environment"}  # the environment wins over .env, in Compose as in ops


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return [shutil.which("docker-compose")] if shutil.which("docker-compose") else None


def write_probe(tmp_path, env_text: str, x_ops: str = "") -> os.PathLike:
    (tmp_path / ".env").write_text(env_text)
    lines = ["services:", "  probe:", "    image: busybox", "    environment:"]
    lines += [f"      {name}: ${{{name}-<unset>}}" for name in NAMES]
    (tmp_path / "compose.yaml").write_text("\n".join(lines) + "\n" + x_ops)
    return tmp_path / "compose.yaml"


def test_env_file_values_are_the_ones_docker_compose_reads(tmp_path):
    compose = compose_command()
    if compose is None:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` is installed (CI: apt-get install docker-compose)"
        )
    path = write_probe(tmp_path, TRICKY_ENV)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **ENVIRON}
    result = subprocess.run(
        [*compose, "-f", str(path), "config"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    theirs = YAML(typ="safe").load(result.stdout)["services"]["probe"]["environment"]
    theirs = {k: str(v).replace("$$", "$") for k, v in theirs.items()}  # config writes a literal $ as $$
    ours = load(path, env=dict(ENVIRON)).services["probe"].environment
    assert ours == theirs
    assert ours["PORT"] == "8123" and ours["HASH"] == "abc#def" and ours["MULTILINE"] == "line one\nline two"


def test_a_comment_after_an_unquoted_value_is_not_part_of_it_and_a_key_alone_sets_nothing(tmp_path):
    x_ops = (
        "    x-ops:\n      port: ${PORT}\n      native: ['{python}', '-m', 'server', '--port', '{port}']\n"
    )
    path = write_probe(tmp_path, "PORT=8123 # my port\nHASH\nexport EXPORTED\n", x_ops)
    service = load(path, env={}).services["probe"]
    assert service.environment["PORT"] == "8123"
    assert service.native == [sys.executable, "-m", "server", "--port", "8123"]
    assert service.environment["HASH"] == service.environment["EXPORTED"] == "<unset>"  # as compose v2: unset
    assert load(path, env={"HASH": "h"}).services["probe"].environment["HASH"] == "h"


def test_values_from_the_environment_and_env_file_are_never_placeholders(tmp_path):
    x_ops = (
        "    x-ops:\n      port: 9000\n"
        "      native: ['{python}', '--model', '${SCRIPTORIUM_MODEL}', '--home', '{home}', '--port', '{port}',"
        " '--cache', '${CACHE:-{home}/cache}']\n"
        "      prepare:\n        - ['{python}', 'pull', '${FROM_DOTENV}']\n"
    )
    path = write_probe(tmp_path, "FROM_DOTENV='{python}{port}'\n", x_ops)
    env = {"SCRIPTORIUM_MODEL": "x{home}y", "SCRIPTORIUM_HOME": "/data/$PORT{port}"}
    service = load(path, env=env).services["probe"]
    assert service.native == [
        sys.executable,
        "--model",
        "x{home}y",
        "--home",
        "/data/$PORT{port}",
        "--port",
        "9000",
        "--cache",
        "/data/$PORT{port}/cache",
    ]  # the file's own placeholders, filled once
    assert service.prepare == [[sys.executable, "pull", "{python}{port}"]]


@pytest.mark.parametrize(
    "text, message",
    [
        ("A=1\nB='never closed\nC=3\n", r"line 2: B: the ' quote is never closed"),
        ('A="x" y\n', r"line 1: A: 'y' follows the closing quote"),
        ("MY KEY=1\n", r"line 1: 'MY KEY=1' is not KEY=VALUE"),
        ("A=${MISSING:?set MISSING}\n", r"line 1: A: \$\{MISSING\} must be set: set MISSING"),
    ],
)
def test_env_file_mistakes_name_the_file_and_line(tmp_path, text, message):
    with pytest.raises(StackError, match=message) as error:
        load(write_probe(tmp_path, text), env={})
    assert str(tmp_path / ".env") in str(error.value)
