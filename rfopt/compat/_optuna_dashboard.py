"""optuna-dashboard's page, given a link to rfopt's.

``dashboard_backlink``  `with_backlink` adds a link to rfopt's page to the HTML optuna-dashboard serves for its
    single-page app (its ``index.html``, before ``</body>``): optuna-dashboard has no extension point for a link, and
    its pages would otherwise never lead to rfopt's. Buys: both UIs link to each other.
"""

from __future__ import annotations


def with_backlink(page: bytes, snippet: bytes) -> bytes | None:
    """optuna-dashboard's page (`page`, its ``index.html``) with `snippet` before ``</body>``; None if the page has no
    ``</body>`` (it changed: the link is left out, the page is served as it is). Entry ``dashboard_backlink``."""
    end = page.rfind(b"</body>")
    return None if end < 0 else page[:end] + snippet + page[end:]
