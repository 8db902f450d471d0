"""One settings object: environment variables over an optional TOML file over defaults."""

import pytest

from common.settings import DEFAULT_LLM_URL, Settings, SettingsError

VARS = ("SCRIPTORIUM_LLM_URL", "SCRIPTORIUM_COMFYUI_URL", "SCRIPTORIUM_LLM_MODEL", "SCRIPTORIUM_MCP_BUDGET",
        "SCRIPTORIUM_CONFIG", "SCRIPTORIUM_LLM_STRUCTURED_OUTPUT", "SCRIPTORIUM_MCP_TOKEN", "SCRIPTORIUM_MAX_JOBS",
        "SCRIPTORIUM_MAX_QUEUED_PER_CLIENT")


@pytest.fixture
def home(tmp_path, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path))
    return tmp_path


def test_defaults(home):
    s = Settings.from_env()
    assert s.home == home and s.llm_urls == (DEFAULT_LLM_URL,) and s.comfyui_url is None and s.mcp_budget == 45
    assert s.jobs_db == home / "jobs.db" and s.runs_dir == home / "runs"


def test_the_toml_file_then_the_environment(home, monkeypatch):
    (home / "config.toml").write_text('llm_urls = ["http://gpu-box:8000/v1/", "http://spare:8000/v1"]\n'
                                      'comfyui_url = "http://127.0.0.1:8188/"\nmcp_budget = 30\n'
                                      'llm_structured_output = false\n')
    s = Settings.from_env()
    assert s.llm_urls == ("http://gpu-box:8000/v1", "http://spare:8000/v1")
    assert s.comfyui_url == "http://127.0.0.1:8188" and s.mcp_budget == 30 and s.llm_structured_output is False
    monkeypatch.setenv("SCRIPTORIUM_LLM_URL", "http://a:1/v1, http://b:2/v1")
    monkeypatch.setenv("SCRIPTORIUM_MCP_BUDGET", "50")
    s = Settings.from_env()
    assert s.llm_urls == ("http://a:1/v1", "http://b:2/v1") and s.mcp_budget == 50
    assert s.comfyui_url == "http://127.0.0.1:8188"  # still from the file


def test_another_config_file_by_variable(home, monkeypatch, tmp_path_factory):
    other = tmp_path_factory.mktemp("etc") / "scriptorium.toml"
    other.write_text('llm_model = "qwen3-8b"\n')
    monkeypatch.setenv("SCRIPTORIUM_CONFIG", str(other))
    assert Settings.from_env().llm_model == "qwen3-8b"


@pytest.mark.parametrize("text,message", [
    ('colour = "red"\n', "unknown setting\\(s\\) colour"),
    ("mcp_budget = -4\n", "mcp_budget = -4 is not usable"),
    ("llm_urls = []\n", "llm_urls"),
    ("llm_urls = [\n", "not valid TOML"),
])
def test_bad_settings_say_where_and_what(home, text, message):
    (home / "config.toml").write_text(text)
    with pytest.raises(SettingsError, match=message):
        Settings.from_env()


def test_the_job_pool_settings(home, monkeypatch):
    s = Settings.from_env()
    assert 2 <= s.max_jobs <= 16 and s.max_queued_per_client == 20
    monkeypatch.setenv("SCRIPTORIUM_MAX_JOBS", "3")
    monkeypatch.setenv("SCRIPTORIUM_MAX_QUEUED_PER_CLIENT", "0")
    s = Settings.from_env()
    assert s.max_jobs == 3 and s.max_queued_per_client == 0
    monkeypatch.setenv("SCRIPTORIUM_MAX_JOBS", "0")
    with pytest.raises(SettingsError, match="SCRIPTORIUM_MAX_JOBS: max_jobs = '0' is not usable"):
        Settings.from_env()
