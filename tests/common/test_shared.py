"""The shared leaf pieces: the memory-size grammar, the data directory, hashing, the record of agent configs
install changed, and the backend's sleep/wake root."""

import os

import pytest

from common import agent_configs, backend_client, paths
from common.hashing import fingerprint, sha256_file
from common.sizes import SizeError, in_bytes, parse_memory

GIB = 2**30


def test_memory_sizes():
    assert parse_memory("18GiB") == 18 * GIB and parse_memory("20GB") == 20 * 10**9
    assert parse_memory(" 512 MiB ") == 512 * 2**20 and parse_memory("19327352832") == 19327352832
    assert parse_memory("0.45") == 0.45 and parse_memory(0.4) == 0.4 and parse_memory(1024) == 1024
    assert in_bytes(0.5, 8 * GIB) == 4 * GIB and in_bytes(3 * GIB, 8 * GIB) == 3 * GIB
    for bad, message in (("12 parsecs", "unknown unit"), ("lots", "not a size"),
                         ("1.5", "a fraction of the card is at most 1"), (1.5, "must be in \\[0, 1\\]")):
        with pytest.raises(SizeError, match=message):
            parse_memory(bad)


def test_data_home_and_hashes(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path / "h"))
    assert paths.data_home() == tmp_path / "h" and paths.state_dir() == tmp_path / "h" / "state"
    monkeypatch.delenv("SCRIPTORIUM_HOME")
    assert paths.data_home() == paths.Path(os.path.expanduser("~/.local/share/scriptorium"))
    (tmp_path / "f").write_bytes(b"abc")
    digest = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert sha256_file(tmp_path / "f") == digest and fingerprint(b"abc") == {"sha256": digest, "size": 3}


def test_agent_config_record(tmp_path):
    config = tmp_path / "cfg" / "mcp.json"
    config.parent.mkdir()
    assert agent_configs.remembered(tmp_path) == []
    agent_configs.remember(config, tmp_path)
    agent_configs.remember(config, tmp_path)
    assert agent_configs.remembered(tmp_path) == [config]
    (config.parent / "mcp.json.20260101-000000.scriptorium.bak").write_text("{}")
    (config.parent / "other.json.20260101-000000.scriptorium.bak").write_text("{}")
    assert [p.name for p in agent_configs.backups_of(config)] == ["mcp.json.20260101-000000.scriptorium.bak"]
    agent_configs.record_path(tmp_path).write_text("{broken")
    assert agent_configs.remembered(tmp_path) == []  # a damaged record reads as none


def test_backend_root():
    assert backend_client.root("http://h:8000/v1/") == "http://h:8000"
    assert backend_client.root("http://h:8000") == "http://h:8000"
    assert backend_client.is_sleeping("http://127.0.0.1:9") is False  # cannot be asked: not asleep
