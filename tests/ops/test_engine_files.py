"""What the engines/*.yaml files name of this repository exists: the files their comments point to, and the
commands (python -m backend ...) they run."""

import re
import subprocess
import sys

import pytest
from ruamel.yaml import YAML

from tests.backend.server_process import ROOT

ENGINE_FILES = sorted((ROOT / "engines").glob("*.yaml"))
# a path such as orchestrator/image_lease.py or compose.yaml (another project's, e.g. vllm/..., is left alone)
PATH = re.compile(r"(?<![\w./-])([\w-]+(?:/[\w.-]+)*\.(?:py|yaml|md))\b")


def _ours(path: str) -> bool:
    first = path.split("/")[0]
    return "/" not in path or (ROOT / first).is_dir()


def _commands(node) -> list[list[str]]:
    """Every list of strings in the file that runs a Python module (-m)."""
    if isinstance(node, dict):
        return [c for value in node.values() for c in _commands(value)]
    if isinstance(node, list):
        if node and all(isinstance(x, str) for x in node) and "-m" in node:
            return [node]
        return [c for item in node for c in _commands(item)]
    return []


def _our_module_commands() -> list[tuple[str, tuple[str, ...]]]:
    """(file, the module and its subcommand words) for each command that runs one of our packages."""
    found = []
    for file in ENGINE_FILES:
        for command in _commands(YAML(typ="safe").load(file.read_text())):
            words = command[command.index("-m") + 1 :]
            if (ROOT / words[0].split(".")[0]).is_dir():
                sub = []
                for word in words[1:]:
                    if word.startswith("-") or "$" in word or "{" in word:
                        break
                    sub.append(word)
                found.append((file.name, [words[0], *sub]))
    return list(dict.fromkeys((f, tuple(w)) for f, w in found))


@pytest.mark.parametrize("file", ENGINE_FILES, ids=lambda f: f.name)
def test_the_files_an_engine_file_names_exist(file):
    named = [p for p in PATH.findall(file.read_text()) if _ours(p)]
    missing = [p for p in named if not (ROOT / p).exists()]
    assert named and not missing, f"{file.name} names {missing}, which do not exist"


def test_the_modules_and_subcommands_engine_files_run_exist():
    commands = _our_module_commands()
    assert commands  # scriptorium.yaml runs python -m backend serve
    for file, words in commands:
        result = subprocess.run(
            [sys.executable, "-m", *words, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert result.returncode == 0, f"{file}: python -m {' '.join(words)}: {result.stderr.strip()[-500:]}"
