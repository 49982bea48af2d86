"""Check that built HTML loads no script or stylesheet from the network (math renders offline).

Usage: ``python docs/check_offline.py docs/_build/html`` (run by ``nox -s docs``); exits 1
and lists each page and address otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: a <script src=...> or <link href=...> with an absolute http(s) or protocol-relative address
REMOTE = re.compile(r"""<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*["']((?:https?:)?//[^"']+)["']""", re.I)


def remote_assets(html_dir: str | Path) -> list[tuple[str, str]]:
    """``(page, address)`` for every remote script or stylesheet in the HTML under ``html_dir``."""
    found = []
    for page in sorted(Path(html_dir).rglob("*.html")):
        for match in REMOTE.finditer(page.read_text(encoding="utf-8", errors="replace")):
            found.append((str(page.relative_to(html_dir)), match.group(1)))
    return found


def main(argv: list[str]) -> int:
    html_dir = Path(argv[0] if argv else "docs/_build/html")
    if not any(html_dir.rglob("*.html")):
        print(f"check_offline: no HTML under {html_dir}", file=sys.stderr)
        return 1
    found = remote_assets(html_dir)
    for page, url in found:
        print(f"{page}: loads {url}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
