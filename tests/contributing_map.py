"""CONTRIBUTING.md's map names every part under include/accel/, and only those (CTest contributing_map).

    python3 tests/contributing_map.py SOURCE_DIR

The map is the list under "Every part, by tier and family": an item per folder,
`folder/` first, then each part by its name without `.hpp`, in backquotes
(parenthesized text says what a part holds and names no part).
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
text = (root / "CONTRIBUTING.md").read_text()
start = text.index("Every part, by tier and family")
end = text.index("\n\n", text.index("\n- ", start))
named = set()
for item in re.split(r"\n- ", text[start:end])[1:]:
    folder = re.match(r"`([a-z_/]+/)`", item)
    if not folder:
        sys.exit(f"contributing_map: an item of the map does not start with its folder: {item[:60]!r}")
    # every backquoted name after the folder, outside parentheses (which say what a part holds)
    for name in re.findall(r"`([a-z_0-9]+)`", re.sub(r"\([^()]*\)", "", item[folder.end():])):
        named.add(f"accel/{folder.group(1)}{name}.hpp")
on_disk = {str(p.relative_to(root / "include")) for p in (root / "include" / "accel").glob("*/**/*.hpp")}
missing, stale = sorted(on_disk - named), sorted(named - on_disk)
if missing or stale:
    print("contributing_map: CONTRIBUTING.md's map " +
          (f"lacks {', '.join(missing)}" if missing else "") + ("; " if missing and stale else "") +
          (f"names {', '.join(stale)}, which is no part" if stale else ""))
    sys.exit(1)
print(f"contributing_map: CONTRIBUTING.md names all {len(on_disk)} parts")
