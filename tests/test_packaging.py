"""What a non-editable install (``pip install /path/to/shardmax``, the README's vLLM install)
and the tuner need from the checked-in tree."""

from __future__ import annotations

import json
from pathlib import Path

import tomllib

from generator.__main__ import stale_resources
from generator.render import generated_dir

ROOT = Path(__file__).resolve().parent.parent


def test_every_runtime_subpackage_is_packaged() -> None:
    """Every folder under ``shardmax/`` with an ``__init__.py`` ships in the wheel (a missing
    ``shardmax.testing`` once broke the tuner and the demo outside an editable install)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packaged = set(cfg["packages"])
    found = {
        "shardmax." + ".".join(p.parent.relative_to(ROOT / "shardmax").parts)
        for p in (ROOT / "shardmax").rglob("__init__.py")
        if p.parent != ROOT / "shardmax" and "__pycache__" not in p.parts
    }
    assert found <= packaged, f"not packaged: {sorted(found - packaged)}"


def test_aot_resources_cover_exactly_the_generated_variants() -> None:
    """``generated/<arch>/resources.json`` (registers / spills the tuner prunes with) lists
    every variant of the MANIFEST and nothing else."""
    manifest = json.loads((generated_dir() / "MANIFEST.json").read_text())
    names = [v["name"] if isinstance(v, dict) else v for v in manifest["variants"]]
    assert stale_resources(generated_dir(), names) == []
