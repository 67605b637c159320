#!/usr/bin/env bash
# Build the documentation site (MkDocs Material + mkdocstrings, mkdocs.yml) into build/site
# (or $DOCS_SITE_DIR), strict: a broken link, a missing page or a docstring the reference cannot
# render is an error. `bash scripts/docs.sh serve` serves it on http://127.0.0.1:8000 instead,
# rebuilding on edits. Needs the `docs` extra (scripts/setup.sh installs it).
# tests/test_docs_site.py builds the site with this script.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = serve ]; then
  exec .venv/bin/mkdocs serve --strict -a 127.0.0.1:8000
fi
site="${DOCS_SITE_DIR:-build/site}"
.venv/bin/mkdocs build --strict --clean -d "$site"
echo "docs: open file://$(cd "$site" && pwd)/index.html (or: bash scripts/docs.sh serve)"
