#!/usr/bin/env python3
"""Assembles accel.hpp, the one file users copy, from the parts under include/accel/.

    python3 tools/amalgamate.py          write accel.hpp
    python3 tools/amalgamate.py --check  exit 1 if accel.hpp differs from what the
                                         parts give, naming the first part that differs

tools/accel.hpp.in is the frame: the single header's first lines and the guards of
its three tiers. There, `@contents@` becomes a list of every part with its title,
and `@parts TIER@` becomes the parts that include/accel/TIER.hpp lists, in that
order. Each part is inlined once, under a banner "// == accel/TIER/NAME.hpp",
without its `#pragma once` and without its includes of other parts.

A part starts with the line "// accel/TIER/NAME.hpp: its title." (NAME may name a
folder: accel/training/dp/units.hpp) and includes the parts it uses. The order is
computed from those includes: each part comes after every part it includes (a
part of an earlier tier is inlined with its tier), and where the includes leave
the order open, in the order the umbrella header lists them; a cycle stops the
script, naming it. The umbrella must list every part of its tier. A part of the
distributed tier reaches distributed/torch.hpp through its includes, and one of
the training tier training/torch_nn.hpp: the LibTorch headers are what puts a
part in its tier. Anything else stops the script with the reason. The standard
library only: this runs wherever the tests do.
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
TIERS = ("core", "distributed", "training")
PART_INCLUDE = re.compile(r'^#include "(accel/[^"]+)"\s*(//.*)?$')
BANNER_WIDTH = 80
# The part holding each tier's LibTorch headers, which every other part of the tier reaches.
TIER_BASE = {"distributed": "accel/distributed/torch.hpp", "training": "accel/training/torch_nn.hpp"}


class PartError(Exception):
    pass


def listed_parts(tier):
    """The parts include/accel/TIER.hpp lists, in its order; every part of the tier's folder must be there."""
    umbrella = INCLUDE / "accel" / f"{tier}.hpp"
    listed = []
    for line in umbrella.read_text().splitlines():
        m = PART_INCLUDE.match(line)
        if m and m.group(1).startswith(f"accel/{tier}/"):
            listed.append(m.group(1))
    on_disk = sorted(str(p.relative_to(INCLUDE)) for p in (INCLUDE / "accel" / tier).rglob("*.hpp"))
    unlisted = sorted(set(on_disk) - set(listed))
    if unlisted:
        raise PartError(f"{umbrella.relative_to(ROOT)} does not list {', '.join(unlisted)}")
    missing = sorted(set(listed) - set(on_disk))
    if missing:
        raise PartError(f"{umbrella.relative_to(ROOT)} lists {', '.join(missing)}, which is not a file")
    if len(set(listed)) != len(listed):
        raise PartError(f"{umbrella.relative_to(ROOT)} lists a part twice")
    return listed


def tier_parts(tier, earlier=()):
    """The parts of a tier in the order accel.hpp inlines them: each after every part it includes, else in
    the umbrella's order. `earlier`: the parts of the tiers before (included freely)."""
    listed = listed_parts(tier)
    includes = {name: read_part(name)[2] for name in listed}
    for name, used in includes.items():
        for used_name in used:
            if used_name not in includes and used_name not in earlier:
                raise PartError(f"include/{name}: includes {used_name}, which is no part of its tier or of a tier "
                                f"before it")
    # Kahn's order: each time, the first part in the umbrella's listing whose includes are all placed.
    order, waiting = [], list(listed)
    while waiting:
        ready = next((name for name in waiting if all(u in order or u not in includes for u in includes[name])), None)
        if ready is None:
            raise PartError("the parts include each other in a cycle: " + cycle_among(waiting, includes))
        order.append(ready)
        waiting.remove(ready)
    return order


def cycle_among(waiting, includes):
    """A cycle among the parts not placed (each includes one of the others), as 'a -> b -> a'."""
    path = [waiting[0]]
    while True:
        following = next(u for u in includes[path[-1]] if u in waiting)
        if following in path:
            return " -> ".join(path[path.index(following):] + [following])
        path.append(following)


def read_part(name):
    """A part's title, its lines as they go into accel.hpp, and the parts it includes."""
    path = INCLUDE / name
    lines = path.read_text().splitlines()
    title = re.match(rf"^// {re.escape(name)}: (.+?)\.?$", lines[0] if lines else "")
    if not title:
        raise PartError(f"include/{name}: the first line must be '// {name}: <what it holds>.'")
    if "#pragma once" not in lines:
        raise PartError(f"include/{name}: no #pragma once")
    body, includes = [], []
    for number, line in enumerate(lines, 1):
        if line == "#pragma once":
            continue
        m = PART_INCLUDE.match(line)
        if m:
            includes.append(m.group(1))
            continue
        if re.match(r'^\s*#\s*include\s*["<]accel/', line):  # would reach the include tree from accel.hpp
            raise PartError(f"include/{name}:{number}: write a part's include as '#include \"accel/...\"' on a line "
                            f"of its own (a trailing // comment allowed), so that accel.hpp inlines it")
        body.append(line)
    text = "\n".join(body)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")  # the blank lines the includes leave
    return title.group(1), text.split("\n"), includes


def check_reaches_tier_base(name, reaches):
    """A distributed or training part reaches its tier's LibTorch part (TIER_BASE)."""
    base = TIER_BASE.get(name.split("/")[1])
    if base and name != base and base not in reaches:
        raise PartError(f"include/{name}: reaches no {base} through its includes; a part of its tier "
                        f"uses LibTorch, so it includes that part or one that does")


def assemble():
    """accel.hpp's lines, and for each line the file it came from."""
    frame_path = ROOT / "tools" / "accel.hpp.in"
    parts = {}  # name -> (title, lines), in order
    reaches = {}  # name -> every part it includes, directly or not
    for tier in TIERS:
        for name in tier_parts(tier, set(parts)):
            title, lines, includes = read_part(name)
            parts[name] = (title, lines)
            reaches[name] = set(includes).union(*(reaches[i] for i in includes))
            check_reaches_tier_base(name, reaches[name])
    out, origin = [], []

    def emit(lines, source):
        out.extend(lines)
        origin.extend([source] * len(lines))

    for line in frame_path.read_text().splitlines():
        if line == "@contents@":
            width = max(len(name) for name in parts) + 2
            for tier in TIERS:
                emit([f"//   {tier}:"], "tools/accel.hpp.in")
                for name, (title, _) in parts.items():
                    if name.startswith(f"accel/{tier}/"):
                        emit([f"//     {name.ljust(width)}{title}"], name)
        elif re.match(r"^@parts (\w+)@$", line):
            tier = line[len("@parts "):-1]
            first = True
            for name, (_, lines) in parts.items():
                if not name.startswith(f"accel/{tier}/"):
                    continue
                if not first:
                    emit([""], name)
                first = False
                banner = f"// == {name} "
                emit([banner + "=" * max(3, BANNER_WIDTH - len(banner))], name)
                emit(lines, name)
        else:
            emit([line], "tools/accel.hpp.in")
    return out, origin


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with accel.hpp instead of writing it")
    parser.add_argument("--output", default=str(ROOT / "accel.hpp"))
    args = parser.parse_args()
    try:
        lines, origin = assemble()
    except PartError as e:
        print(f"amalgamate: {e}", file=sys.stderr)
        return 2
    text = "\n".join(lines) + "\n"
    output = pathlib.Path(args.output)
    if not args.check:
        output.write_text(text)
        return 0
    committed = output.read_text().splitlines() if output.exists() else []
    for number, (want, have) in enumerate(zip(lines, committed), 1):
        if want != have:
            break
    else:
        if len(lines) == len(committed):
            print(f"amalgamate: {output.name} is what the parts give ({len(lines)} lines)")
            return 0
        number = min(len(lines), len(committed)) + 1
    source = origin[min(number, len(origin)) - 1]
    print(f"amalgamate: {output.name} differs from the parts at its line {number}, in {source}:\n"
          f"  parts give: {lines[number - 1] if number <= len(lines) else '(end of file)'}\n"
          f"  file has:   {committed[number - 1] if number <= len(committed) else '(end of file)'}\n"
          f"accel.hpp is generated: edit include/accel/ (or tools/accel.hpp.in), then run "
          f"python3 tools/amalgamate.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
