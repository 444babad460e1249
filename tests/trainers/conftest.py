"""Shared fixtures for the trainer harness (tests/trainers): where each trainer's sources are.

scripts/fetch-trainers extracts each trainer named in tests/trainers/COMMITS, at its commit, to
<cache>/<owner>+<name>-<commit> (<cache>: $BLOCKSWAP_TRAINERS_CACHE, default
~/.cache/blockswap/trainers). A test asks for it with the `trainer_root` fixture:

    def test_x(trainer_root):
        root = trainer_root("musubi-tuner")      # a pathlib.Path, or the test skips, saying why
"""
import os
import pathlib

import pytest

_COMMITS = pathlib.Path(__file__).with_name("COMMITS")


def _cache():
    return pathlib.Path(os.environ.get("BLOCKSWAP_TRAINERS_CACHE")
                        or pathlib.Path.home() / ".cache" / "blockswap" / "trainers")


def find_trainer_root(name):
    """The extracted tree of trainer `name` ("musubi-tuner", or "owner/name") at the commit
    COMMITS records; pytest.skip with the reason when it is not there."""
    for line in _COMMITS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        repo, commit = line.split()[:2]
        if repo == name or repo.split("/", 1)[1] == name:
            root = _cache() / f"{repo.replace('/', '+')}-{commit}"
            if not (root / ".blockswap-commit").is_file():
                pytest.skip(f"{repo}@{commit} is not in {_cache()}: run scripts/fetch-trainers "
                            "(it extracts the trainers' sources at the commits tests/trainers/"
                            "COMMITS records)")
            return root
    pytest.skip(f"no trainer named {name!r} in {_COMMITS}")


@pytest.fixture(scope="session")
def trainer_root():
    """trainer_root(name) -> pathlib.Path of that trainer's extracted sources (or a skip)."""
    return find_trainer_root
