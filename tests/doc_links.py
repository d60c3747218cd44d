#!/usr/bin/env python3
"""Checks the links of the repository's Markdown files: every relative link
names a file that exists, and every #anchor names a heading of its file, as
GitHub makes anchors from headings. Links to other sites are not fetched.
It also reports a heading that appears twice under the same parent heading.

Usage: python3 tests/doc_links.py [FILE.md ...]   (default: every tracked .md)
Exit status 1 when something is wrong, with one line per problem.
"""

import os
import re
import subprocess
import sys

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading):
    """GitHub's anchor for a heading: lower case, inline markup dropped,
    punctuation other than '-' and '_' removed, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def outside_fences(path):
    """The file's lines that are not inside ``` or ~~~ fences, numbered."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = re.match(r"^\s*(```|~~~)", line)
            if m:
                if fence is None:
                    fence = m.group(1)
                elif fence == m.group(1):
                    fence = None
                continue
            if fence is None:
                yield number, line.rstrip("\n")


def anchors(path, problems):
    seen = {}
    found = set()
    by_level = {}
    parents = []  # (level, text) of the headings above this one
    for number, line in outside_fences(path):
        m = HEADING.match(line)
        if not m:
            continue
        level, text = len(m.group(1)), m.group(2)
        while parents and parents[-1][0] >= level:
            parents.pop()
        key = (tuple(parents), level, text)
        parents.append((level, text))
        if key in by_level:
            problems.append(
                f"{path}:{number}: heading {text!r} again (first at line {by_level[key]})"
            )
        else:
            by_level[key] = number
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def main(files):
    problems = []
    cache = {}

    def anchors_of(path):
        if path not in cache:
            cache[path] = anchors(path, problems)
        return cache[path]

    for path in files:
        anchors_of(path)
        for number, line in outside_fences(path):
            # Inline code never holds a link.
            line = re.sub(r"`[^`]*`", "", line)
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = (
                    os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                    if file_part
                    else path
                )
                if not os.path.exists(dest):
                    problems.append(f"{path}:{number}: {target}: no file {dest}")
                    continue
                if anchor and dest.endswith(".md") and anchor not in anchors_of(dest):
                    problems.append(f"{path}:{number}: {target}: no heading #{anchor} in {dest}")
    for p in problems:
        print(p)
    print(f"doc_links: {len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        out = subprocess.run(
            ["git", "ls-files", "*.md"], capture_output=True, text=True, check=True
        ).stdout
        args = [f for f in out.split("\n") if f]
    sys.exit(main(args))
