#!/usr/bin/env python3
"""Writes docs/api.md, the signature of every public name, from the parts under include/accel/.

    python3 tools/api_reference.py          write docs/api.md
    python3 tools/api_reference.py --check  exit 1 if docs/api.md differs from what the parts give

For each part, in accel.hpp's order: what it declares outside accel::detail,
with bodies left out, and the classes of accel::detail that a public class
derives from (their public members are that class's: the error classes'
what() and the like). A member defined outside its class shows once, where
the class declares it. A function shows its signature; a struct or class its
public members (data members with their defaults and comments); an enum, a
concept or a using-declaration itself. The comment just above a declaration
comes with it. Being generated, the page cannot drift from the code: the
CTest entry api_reference_in_sync fails when it does. The standard library
only.
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from amalgamate import INCLUDE, TIERS, tier_parts  # noqa: E402  (one order of the parts)


def ordered_parts():
    """Every part, tier by tier, in accel.hpp's order."""
    parts = []
    for tier in TIERS:
        parts += tier_parts(tier, set(parts))
    return parts


OUTPUT = ROOT / "docs" / "api.md"
PUBLIC_BASES = set()  # classes of accel::detail that a public class derives from (set by render)


def code_mask(text):
    """A copy of text with comments and string/char literals blanked (same length), so that
    braces and semicolons can be matched on it."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) + len(m.group(1)) + 2
            for k in range(i + 1, end - 1):
                if out[k] != "\n":
                    out[k] = " "
            i = end
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 10'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, j):
                out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def match_brace(mask, i):
    """The index just past the brace that closes the one at i."""
    depth = 0
    for j in range(i, len(mask)):
        if mask[j] == "{":
            depth += 1
        elif mask[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError("unbalanced braces")


def signature(head):
    """A function's head without a constructor's member initializers."""
    depth, opened = 0, False
    for k, c in enumerate(head):
        if c in "(<[":
            depth += 1
            opened = opened or c == "("
        elif c in ")>]":
            depth -= 1
        elif c == ":" and depth == 0 and opened and head[k - 1] != ":" and head[k + 1:k + 2] != ":":
            return head[:k].rstrip()
    return head


def declarations(text, mask, start, end, in_class=False, public=True):
    """The public declarations in text[start:end], each as lines of text."""
    out = []
    i = start
    comment = []
    while i < end:
        line_end = text.find("\n", i)
        line_end = end if line_end < 0 or line_end > end else line_end
        line = text[i:line_end]
        stripped = line.strip()
        if not stripped:
            comment = []
            i = line_end + 1
            continue
        if stripped.startswith("//"):
            comment.append(line)
            i = line_end + 1
            continue
        if stripped.startswith("#"):  # preprocessor: the declarations inside it count, the lines do not
            comment = []
            i = line_end + 1
            continue
        if in_class and re.match(r"^(public|private|protected):", stripped):
            public = stripped.startswith("public")
            comment = []
            i = line_end + 1
            continue
        # One declaration: up to a ';' or a '{...}' body at this level, whichever comes first.
        j = i
        while j < end and mask[j] not in ";{":
            if mask[j] == "(":  # parameter lists may hold braces (default arguments)
                depth = 0
                while j < end:
                    depth += mask[j] == "("
                    depth -= mask[j] == ")"
                    j += 1
                    if depth == 0:
                        break
                continue
            j += 1
        head = text[i:j].rstrip()
        if j >= end:
            break
        if mask[j] == ";":
            stop = j + 1
            body = None
        else:
            stop = match_brace(mask, j)
            while stop < end and mask[stop] in " \t":
                stop += 1
            if stop < end and mask[stop] == ";":
                stop += 1
            body = (j, stop)
        nl = text.find("\n", stop)
        nxt = end if nl < 0 or nl > end else nl + 1
        keep = public and not re.match(r"^\s*(friend\b|static_assert|using namespace)", head)
        # A member defined outside its class (`T Accelerator::gather(...)`; classes are capitalized,
        # namespaces not): the class shows its declaration.
        if not in_class and re.search(r"(^|[\s&*>])[A-Z]\w*::(~?\w+|operator\W+)\s*\(", mask[i:j]):
            keep = False
        first = head.lstrip()
        if re.match(r"^namespace detail\b", first) or first.startswith("namespace detail"):
            keep = False
            if public and body is not None and not in_class:
                bases = [block for block in declarations(text, mask, j + 1, body[1] - 1)
                         if any(re.match(r"^\s*class (\w+)", line) and re.match(r"^\s*class (\w+)", line).group(1)
                                in PUBLIC_BASES for line in block)]
                if bases:
                    out.append(["namespace detail {  // the bases of public classes"])
                    out.extend(bases)
                    out.append(["}  // namespace detail"])
        if keep and body is not None and re.match(r"^namespace \w+", first):  # a public one (autograd, comm_hooks)
            out.append(comment + [head + " {"])
            out.extend(declarations(text, mask, j + 1, body[1] - 1))
            out.append([f"}}  // {first}"])
        elif keep and body is not None and re.search(r"\benum\b", head):
            out.append(comment + [text[i:body[1]].rstrip()])
        elif keep and body is not None and re.search(r"\b(struct|class|union)\s+\w+[^(]*$", head) \
                and not re.search(r"\)\s*(const\s*)?(noexcept\s*)?$", head):
            is_struct = re.search(r"(^|\s)(struct|union)\s", head.split("\n")[-1]) is not None
            members = declarations(text, mask, j + 1, body[1] - 1, in_class=True, public=is_struct)
            block = comment + [head + " {"]
            for m in members:
                block.extend(m)
            block.append(" " * (len(head) - len(head.lstrip())) + "};")
            out.append(block)
        elif keep and body is not None and re.search(r"\bconcept\b", head):
            out.append(comment + [text[i:body[1]].rstrip()])
        elif keep and body is not None:
            # A function (or a variable with a braced initializer): the head alone.
            if re.search(r"(=|\binline constexpr\b)\s*$", head) or re.search(r"\w\s*$", head) and "(" not in head:
                out.append(comment + [text[i:nl if 0 <= nl < end else body[1]].rstrip()])
            else:
                out.append(comment + [signature(head) + ";"])
        elif keep:  # a declaration ending in ';', with its trailing comment
            out.append(comment + [text[i:nl if 0 <= nl < end else stop].rstrip()])
        comment = []
        i = nxt
    return out


def part_api(name):
    text = (INCLUDE / name).read_text()
    title = text.splitlines()[0].split(": ", 1)[1].rstrip(".")
    begin_match = re.search(r"^ACCEL_NAMESPACE_BEGIN$", text, re.M)
    if not begin_match:
        return title, []
    begin = begin_match.start()
    stop = [m.start() for m in re.finditer(r"^ACCEL_NAMESPACE_END$", text, re.M)][-1]
    mask = code_mask(text)
    start = text.find("\n", begin) + 1
    return title, declarations(text, mask, start, stop)


def render():
    derives = {}  # class -> the classes it derives from publicly
    for name in ordered_parts():
        text = code_mask((INCLUDE / name).read_text())
        PUBLIC_BASES.update(re.findall(r"public detail::(\w+)", text))
        for cls, bases in re.findall(r"\bclass (\w+)\s*(?:final\s*)?:([^{;]*)\{", text):
            derives.setdefault(cls, set()).update(re.findall(r"public (?:detail::)?(\w+)", bases))
    # and their own bases, whose public members are the public class's too
    while True:
        more = set().union(*(derives.get(cls, set()) for cls in PUBLIC_BASES)) - PUBLIC_BASES
        if not more:
            break
        PUBLIC_BASES.update(more)
    lines = [
        "# API reference",
        "",
        "*Part of the [accel.hpp](../README.md) documentation. Generated by `tools/api_reference.py` from",
        "the parts under `include/accel/`: do not edit (the CTest entry `api_reference_in_sync` fails when",
        "it differs from the code).*",
        "",
        "Every name outside `accel::detail`, part by part in accel.hpp's order, with its comment; bodies",
        "left out; and the classes of `accel::detail` that a public class derives from, whose public",
        "members are that class's. Everything is in namespace `accel` (an inline namespace for the ABI,",
        "never spelled).",
        "What the names do, with examples: the other pages of `docs/`.",
        "",
    ]
    parts = ordered_parts()
    for tier in TIERS:
        lines += [f"## {tier}", ""]
        for name in (part for part in parts if part.startswith(f"accel/{tier}/")):
            title, decls = part_api(name)
            if not decls:
                continue
            lines += [f"### `{name}`", "", title + ".", "", "```cpp"]
            for k, block in enumerate(decls):
                if k:
                    lines.append("")
                lines += block
            lines += ["```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if not args.check:
        OUTPUT.write_text(text)
        return 0
    if OUTPUT.exists() and OUTPUT.read_text() == text:
        print(f"api_reference: {OUTPUT.relative_to(ROOT)} is what the parts give")
        return 0
    print(f"api_reference: {OUTPUT.relative_to(ROOT)} differs from the parts: run python3 tools/api_reference.py",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
