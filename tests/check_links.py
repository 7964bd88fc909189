#!/usr/bin/env python3
"""Every relative link in the project's Markdown (README.md, CONTRIBUTING.md,
docs/*.md) must reach a file that exists and, with a #fragment, a heading of
that file (GitHub's anchors: lower case, punctuation dropped, spaces as
hyphens, a repeated heading numbered -1, -2, ...). Links to other sites are
not followed (CI has no network). Exits 1 listing every broken link.

    python3 tests/check_links.py [ROOT]
"""
import pathlib
import re
import sys

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_lines(path):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading):
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # GitHub keeps letters, digits, _, - and spaces
    return text.replace(" ", "-")


def anchors(path):
    seen = {}
    found = set()
    for line in markdown_lines(path):
        m = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    pages = [p for p in [root / "README.md", root / "CONTRIBUTING.md"] if p.exists()]
    pages += sorted((root / "docs").glob("*.md"))
    broken, checked = [], 0
    for page in pages:
        for number, line in enumerate(markdown_lines(page), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                checked += 1
                path, _, fragment = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(root)}: ({target})"
                if not dest.exists():
                    broken.append(f"{where}: no file {path}")
                elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                    broken.append(f"{where}: no heading #{fragment} in {dest.relative_to(root)}")
    for line in broken:
        print(line)
    print(f"check_links: {checked} links in {len(pages)} pages, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
