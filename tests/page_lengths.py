#!/usr/bin/env python3
"""Every page of the documentation (README.md, CONTRIBUTING.md, docs/*.md)
reads as a page: at most 400 lines, but the generated docs/api.md. A page
that grows past it is split by subject (as docs/references.md came out of
docs/tests.md), and dated runs go to tests/bench/results/, not docs/.
Exits 1 naming each page over the limit.

    python3 tests/page_lengths.py [ROOT]
"""
import pathlib
import sys

LIMIT = 400
GENERATED = {"docs/api.md"}


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    pages = [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
    long = []
    for page in pages:
        name = page.relative_to(root).as_posix()
        lines = len(page.read_text().splitlines())
        if name not in GENERATED and lines > LIMIT:
            long.append(f"{name}: {lines} lines")
    if long:
        print(f"page_lengths: over {LIMIT} lines (split the page by subject):", *long, sep="\n  ", file=sys.stderr)
        return 1
    print(f"page_lengths: {len(pages) - len(GENERATED)} pages, each at most {LIMIT} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
