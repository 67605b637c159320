#!/usr/bin/env bash
# Build the documentation site (MkDocs Material + mkdocstrings, mkdocs.yml) into build/site,
# strict: a broken link, a missing page or a docstring the reference cannot render is an error.
# `bash scripts/docs.sh serve` serves it on http://127.0.0.1:8000 instead, rebuilding on edits.
# Needs the `docs` extra (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = serve ]; then
  exec .venv/bin/mkdocs serve --strict -a 127.0.0.1:8000
fi
.venv/bin/mkdocs build --strict --clean
echo "docs: open file://$PWD/build/site/index.html (or: bash scripts/docs.sh serve)"
