"""Where the repository's own files are, for tests that read them (configs/, README.md, pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
