#!/usr/bin/env python3
"""Checks the links of the built book (`make docs`: target/book): every
link of every page (`<a href>`, and `<img src>`) that is not to another
site must name a file of the book, and its #anchor an id of that file (or
of the page itself). A link that leaves the book's directory fails too: a
reader of the book could not follow it (name such a file in backticks).

mdBook's own files are not checked: its 404 page (whose links are
absolute, for a site's root) and the print page (every chapter again,
whose links mdBook rewrites to anchors of its own).

Usage: python3 tests/book_links.py BOOK_DIR
Exit status 1 when something is wrong, with one line per problem.
"""

import os
import sys
from html.parser import HTMLParser
from urllib.parse import unquote, urlsplit

SKIP = {"404.html", "print.html"}


class Page(HTMLParser):
    """The ids and the links of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []  # (line, target)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if key == "name" and tag != "a":
                continue
            if attrs.get(key):
                self.ids.add(attrs[key])
        target = None
        if tag == "a":
            target = attrs.get("href")
        elif tag == "img":
            target = attrs.get("src")
        if target:
            self.links.append((self.getpos()[0], target))


def parse(path, cache):
    if path not in cache:
        page = Page()
        with open(path, encoding="utf-8") as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def main(book):
    book = os.path.abspath(book)
    if not os.path.isfile(os.path.join(book, "index.html")):
        print(f"book_links: no book in {book} (run `make docs`)")
        return 1
    cache = {}
    problems = []
    pages = 0
    for root, _, files in os.walk(book):
        for name in sorted(files):
            if not name.endswith(".html") or name in SKIP:
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, book)
            pages += 1
            for line, target in parse(path, cache).links:
                parts = urlsplit(target)
                if parts.scheme or target.startswith("//"):
                    continue  # another site (https:, mailto:)
                anchor = unquote(parts.fragment)
                if parts.path:
                    dest = os.path.normpath(os.path.join(root, unquote(parts.path)))
                    if os.path.isdir(dest):
                        dest = os.path.join(dest, "index.html")
                else:
                    dest = path
                if os.path.commonpath([book, dest]) != book:
                    problems.append(f"{rel}:{line}: {target}: leaves the book")
                    continue
                if not os.path.isfile(dest):
                    problems.append(f"{rel}:{line}: {target}: no file {os.path.relpath(dest, book)}")
                    continue
                if anchor and dest.endswith(".html") and anchor not in parse(dest, cache).ids:
                    problems.append(
                        f"{rel}:{line}: {target}: no id {anchor!r} in {os.path.relpath(dest, book)}"
                    )
    for p in problems:
        print(p)
    print(f"book_links: {pages} pages, {len(problems)} problems")
    return 1 if problems or pages == 0 else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
