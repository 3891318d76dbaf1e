"""The vendored upstream files (third_party/) are byte for byte what their SHA256SUMS record."""

from __future__ import annotations

import hashlib

from tests.launch_utils import THIRD_PARTY, UPSTREAM_EXAMPLES

VENDORED = THIRD_PARTY


def _recorded(folder):
    rows = (line.split(None, 1) for line in (folder / "SHA256SUMS").read_text().splitlines() if line.strip())
    return {name.strip(): digest for digest, name in rows}


def test_every_vendored_file_matches_its_recorded_hash_and_none_is_added_or_missing():
    folders = [p.parent for p in VENDORED.glob("*/SHA256SUMS")]
    assert folders, "no vendored upstream folder with a SHA256SUMS"
    for folder in folders:
        recorded = _recorded(folder)
        present = {
            p.relative_to(folder).as_posix()
            for p in folder.rglob("*")
            if p.is_file() and p.name != "SHA256SUMS" and "__pycache__" not in p.parts
        }
        assert present == set(recorded), (
            f"{folder}: files not in SHA256SUMS {sorted(present - set(recorded))}, "
            f"missing {sorted(set(recorded) - present)}"
        )
        changed = [
            name
            for name, digest in recorded.items()
            if hashlib.sha256((folder / name).read_bytes()).hexdigest() != digest
        ]
        assert not changed, f"{folder}: edited upstream files (never edit them; vendor a new tag): {changed}"
        assert (folder / "LICENSE").is_file()


def test_the_examples_folder_the_tests_use_is_the_vendored_one():
    assert UPSTREAM_EXAMPLES.is_dir() and UPSTREAM_EXAMPLES.is_relative_to(VENDORED)
    assert (UPSTREAM_EXAMPLES / "text_to_image" / "train_text_to_image.py").is_file()
