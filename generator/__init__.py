"""Render the Jinja2 templates in ``templates/`` into the checked-in ``generated/`` tree.

``python -m generator [--arch sm90|gfx950|all] [--check]`` (installed: ``shardmax-generate``).
"""

GENERATOR_VERSION = "1"
