"""Generated systemd units and timers pass `systemd-analyze verify` and follow the memory-safe order."""

import configparser
import shutil
import subprocess

import pytest

from tests.backend.server_process import ROOT
from tests.ops.conftest import run_ops

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def parse(path):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(path)
    return parser


@pytest.mark.parametrize("runner", ["process", "docker"])
def test_units_verify_and_follow_the_plan(tmp_path, runner):
    if runner == "docker" and shutil.which("docker") is None:
        pytest.skip("docker client not installed")
    out = tmp_path / "units"
    result = run_ops(tmp_path / "home", "systemd", "print", "--output", str(out), "--profile", "image", "--runner",
                     runner, "--alert", "logger -t scriptorium", env={"SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml")})
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["scriptorium-backend.service", "scriptorium-backup.service", "scriptorium-backup.timer",
                     "scriptorium-comfyui.service", "scriptorium-health.service", "scriptorium-health.timer",
                     "scriptorium-mcp.service"]
    verify = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in out.iterdir())],
                            capture_output=True, text=True, cwd=out)
    assert verify.returncode == 0, verify.stderr

    backend, mcp, comfy = (parse(out / f"scriptorium-{n}.service") for n in ("backend", "mcp", "comfyui"))
    assert "scriptorium-backend.service" in mcp["Unit"]["After"] and mcp["Unit"]["Requires"] == "scriptorium-backend.service"
    assert "scriptorium-mcp.service" in comfy["Unit"]["After"]  # elastic last, after every fixed service
    for unit in (backend, mcp, comfy):
        assert unit["Service"]["Type"] == "exec" and unit["Service"]["Restart"] == "on-failure"
        assert "StartLimitBurst" in unit["Unit"] and "health --wait" in unit["Service"]["ExecStartPost"]
        assert unit["Service"]["ExecStop"]
    assert backend["Service"]["TimeoutStartSec"] == "660"  # the health timeout plus a margin
    if runner == "docker":
        assert "run --rm" in backend["Service"]["ExecStart"] and "org.scriptorium.ops=1" in backend["Service"]["ExecStart"]
    timer = parse(out / "scriptorium-backup.timer")
    assert timer["Timer"]["Persistent"] == "true" and timer["Timer"]["OnCalendar"] == "daily"
    assert parse(out / "scriptorium-health.timer")["Timer"]["OnUnitActiveSec"] == "5min"
    assert "--alert" in parse(out / "scriptorium-health.service")["Service"]["ExecStart"]


def test_install_writes_the_units_and_explains_linger(tmp_path):
    target = tmp_path / "systemd-user"
    result = run_ops(tmp_path / "home", "systemd", "install", "--user",
                     env={"SCRIPTORIUM_SYSTEMD_DIR": str(target), "SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml")})
    assert result.returncode == 0, result.stderr
    assert (target / "scriptorium-backend.service").exists() and (target / "scriptorium-backup.timer").exists()
    assert "loginctl enable-linger" in result.stderr and "systemctl --user daemon-reload" in result.stderr
    assert "WantedBy=default.target" in (target / "scriptorium-backend.service").read_text()


def test_health_wait_blocks_until_healthy_or_times_out(tmp_path):
    import sys

    from tests.backend.server_process import free_port

    port = free_port()
    (tmp_path / "compose.yaml").write_text(f"services:\n  web:\n    image: x\n    x-ops: "
                                           f"{{health: 'http://127.0.0.1:{port}/'}}\n")
    env = {"SCRIPTORIUM_COMPOSE": str(tmp_path / "compose.yaml")}
    late = run_ops(tmp_path, "health", "--wait", "web", "--timeout", "1", env=env)
    assert late.returncode == 1 and "web not healthy after 1 s" in late.stderr
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        assert run_ops(tmp_path, "health", "--wait", "web", "--timeout", "30", env=env).returncode == 0
    finally:
        server.terminate()
        server.wait()


def exec_words(line: str) -> list[str]:
    """An Exec line split and unescaped the way systemd.syntax and systemd.service describe it: words split
    on whitespace outside double quotes, C escapes decoded, then $$ -> $ and %% -> %."""
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", " ": " "}
    words, word, quoted, i, started = [], "", False, 0, False
    while i < len(line):
        c = line[i]
        if c == "\\":
            nxt = line[i + 1]
            if nxt == "x":
                word, i = word + chr(int(line[i + 2:i + 4], 16)), i + 4
            else:
                word, i = word + escapes[nxt], i + 2
            started = True
            continue
        if c == '"':
            quoted, started = not quoted, True
        elif c.isspace() and not quoted:
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + c, True
        i += 1
    if started:
        words.append(word)
    return [w.replace("$$", "$").replace("%%", "%") for w in words]


def test_an_alert_command_cannot_inject_a_directive_and_reaches_ops_intact(tmp_path):
    alert = 'logger -t "ops"\nExecStartPre=/bin/touch /tmp/pwned\t100% $HOME \\ done;\x1b'
    out = tmp_path / "units"
    result = run_ops(tmp_path / "home", "systemd", "print", "--output", str(out), "--alert", alert,
                     env={"SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml")})
    assert result.returncode == 0, result.stderr
    verify = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in out.iterdir())],
                            capture_output=True, text=True, cwd=out)
    assert verify.returncode == 0, verify.stderr
    health = parse(out / "scriptorium-health.service")
    assert set(health["Service"]) <= {"Type", "Environment", "EnvironmentFile", "ExecStart"}
    words = exec_words(health["Service"]["ExecStart"])
    assert words[-2:] == ["--alert", alert]


@pytest.mark.parametrize("runner", ["process", "docker"])
def test_the_mcp_token_and_the_webhook_stay_out_of_the_units(tmp_path, runner):
    if runner == "docker" and shutil.which("docker") is None:
        pytest.skip("docker client not installed")
    import os
    import stat

    home, out = tmp_path / "home", tmp_path / "units"
    token, hook = "tok-3f9a\"$x", "https://hooks.example/T000/B000/s3cr3t"
    result = run_ops(home, "systemd", "print", "--output", str(out), "--runner", runner, "--webhook", hook,
                     env={"SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml"), "SCRIPTORIUM_MCP_TOKEN": token})
    assert result.returncode == 0, result.stderr
    env_file = home / "state" / "systemd.env"
    for unit in out.iterdir():
        text = unit.read_text()
        assert "tok-3f9a" not in text and "s3cr3t" not in text, unit.name
        if unit.suffix == ".service":
            assert f"EnvironmentFile={env_file}" in text.splitlines(), unit.name
    assert stat.S_IMODE(os.stat(env_file).st_mode) == 0o600 and str(env_file) in result.stderr
    assert env_file.read_text().splitlines()[1:] == ['SCRIPTORIUM_ALERT_WEBHOOK="https://hooks.example/T000/B000/s3cr3t"',
                                                     'SCRIPTORIUM_MCP_TOKEN="tok-3f9a\\"\\$x"']
    if runner == "docker":  # the container gets the token from docker's own environment, by name only
        assert " -e SCRIPTORIUM_MCP_TOKEN " in parse(out / "scriptorium-mcp.service")["Service"]["ExecStart"]
    verify = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in out.iterdir())],
                            capture_output=True, text=True, cwd=out)
    assert verify.returncode == 0, verify.stderr
