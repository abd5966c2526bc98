"""Render templates/ into generated/ deterministically (write-if-different) + the MANIFEST."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jinja2

from . import GENERATOR_VERSION
from .space import TEMPLATE_OF_FAMILY, all_variants, template_context

_ROOT = Path(__file__).resolve().parent.parent
"""The checkout (``python -m generator``) or the installed ``shardmax`` package dir: both hold
``templates/`` and ``generated/`` next to ``generator/``. Paths are found from this file, never
through an installed distribution, so a second checkout renders and checks its own files."""


def templates_dir() -> Path:
    return _ROOT / "templates"


def generated_dir() -> Path:
    return _ROOT / "generated"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def template_hashes(tdir: Path) -> dict[str, str]:
    """sha256 of every template file (includes too), by file name, sorted."""
    return {p.name: _sha256(p.read_text()) for p in sorted(tdir.glob("*.j2"))}


def _environment(tdir: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(tdir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render_all(tdir: Path | None = None) -> dict[str, str]:
    """All generated files by relative path: one module per variant + MANIFEST.json."""
    tdir = tdir or templates_dir()
    env = _environment(tdir)
    hashes = template_hashes(tdir)
    files: dict[str, str] = {}
    entries = []
    for key in all_variants():
        template = TEMPLATE_OF_FAMILY[key.family]
        ctx = template_context(key)
        ctx.update(
            generator_version=GENERATOR_VERSION, template=template, template_hash=hashes[template]
        )
        text = env.get_template(template).render(**ctx)
        text = text.rstrip("\n") + "\n"
        files[f"{key.name}.py"] = text
        entries.append(
            {
                "name": key.name,
                "template": template,
                "sha256": _sha256(text),
                **{k: v for k, v in vars(key).items() if v is not None},
            }
        )
    source = {
        "generator_version": GENERATOR_VERSION,
        "templates": hashes,
        "variants": entries,
    }
    manifest_hash = _sha256(json.dumps(source, sort_keys=True))[:16]
    manifest = {"manifest_hash": manifest_hash, **source}
    files["MANIFEST.json"] = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
    return files


def write_if_different(path: Path, text: str) -> bool:
    """Write ``text`` unless the file already holds it (keeps mtimes stable). True if written."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def stale_files(out: Path, files: dict[str, str]) -> list[str]:
    """Relative paths whose content differs from ``files``, plus generated modules to delete."""
    stale = [
        rel
        for rel, text in files.items()
        if not (out / rel).exists() or (out / rel).read_text() != text
    ]
    known = set(files)
    for p in sorted(out.glob("*.py")):
        if p.name != "__init__.py" and p.name not in known:
            stale.append(p.name + " (obsolete)")
    return stale


def write_all(out: Path, files: dict[str, str]) -> list[str]:
    """Write every file that changed and delete obsolete variant modules; returns changes."""
    changed = [rel for rel, text in files.items() if write_if_different(out / rel, text)]
    for p in sorted(out.glob("*.py")):
        if p.name != "__init__.py" and p.name not in files:
            p.unlink()
            changed.append(p.name + " (deleted)")
    return changed
