#!/usr/bin/env python3
"""Check every relative link in the repository's Markdown files.

Scans each tracked *.md file (`git ls-files '*.md'`) for Markdown links and images,
`[text](target)` and `![alt](target)`, outside code blocks and inline code, and checks that
the target exists relative to the file. A `#anchor` on a Markdown target (or a link that is
only `#anchor`, to the same file) must name one of that file's headings, slugged as GitHub
does. Links with a scheme (http:, https:, mailto:, ...) are not checked.

Exits 1 and prints `file:line: target (why)` for each broken link; exits 0 when all resolve.

    python3 scripts/check_links.py            # from anywhere inside the repository
"""

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

# [text](target) or [text](target "title"); text may hold one level of brackets (an image).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def lines_outside_code(path: Path, strip_inline_code: bool = True):
    """(line number, text) of each line outside fenced code, inline code removed unless asked."""
    in_fence = None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if in_fence is None:
                in_fence = m.group(1)
            elif m.group(1) == in_fence:
                in_fence = None
            continue
        if in_fence is None:
            yield n, INLINE_CODE.sub("", line) if strip_inline_code else line


_anchors = {}


def anchors(path: Path) -> set:
    """Every heading anchor of a Markdown file (duplicates numbered -1, -2, ... as GitHub does)."""
    if path not in _anchors:
        seen, found = {}, set()
        for _, line in lines_outside_code(path, strip_inline_code=False):
            m = HEADING.match(line)
            if not m:
                continue
            s = slug(m.group(2))
            if s in seen:
                seen[s] += 1
                found.add(f"{s}-{seen[s]}")
            else:
                seen[s] = 0
                found.add(s)
        # Explicit HTML anchors: <a id="x"></a> or <a name="x">.
        for m in re.finditer(r"<a\s+(?:id|name)=\"([^\"]+)\"", path.read_text(encoding="utf-8")):
            found.add(m.group(1))
        _anchors[path] = found
    return _anchors[path]


def check(root: Path, md: Path):
    for n, line in lines_outside_code(root / md):
        for m in LINK.finditer(line):
            target = m.group(1)
            if SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            if path_part:
                dest = (root / md).parent / path_part
                if path_part.startswith("/"):
                    dest = root / path_part.lstrip("/")
                if not dest.exists():
                    yield n, target, "no such file"
                    continue
            else:
                dest = root / md
            if anchor and dest.is_file() and dest.suffix.lower() == ".md":
                if unquote(anchor).lower() not in anchors(dest):
                    yield n, target, f"no heading #{anchor} in {dest.relative_to(root)}"


def main() -> int:
    root = Path(
        subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    )
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    broken = 0
    for name in files:
        md = Path(name)
        if not (root / md).exists():  # deleted in the working tree, not yet committed
            continue
        for n, target, why in check(root, md):
            print(f"{md}:{n}: {target} ({why})")
            broken += 1
    if broken:
        print(f"{broken} broken link(s) in {len(files)} Markdown files", file=sys.stderr)
        return 1
    print(f"all relative links resolve in {len(files)} Markdown files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
