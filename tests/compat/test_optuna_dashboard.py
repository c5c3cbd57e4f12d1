"""Canaries for rfopt/compat/_optuna_dashboard.py (optuna-dashboard): each fails loudly when the library symbol, or the
call site, that one of rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch
silently doing nothing."""

from rfopt import compat


# ---------------------------------------------------------------------- dashboard_backlink
def test_optuna_dashboards_page_has_a_body_end_where_the_link_to_rfopt_goes():
    from pathlib import Path

    import optuna_dashboard

    page = (Path(optuna_dashboard.__file__).parent / "index.html").read_bytes()
    linked = compat.with_backlink(page, b"<a id='x'></a>")
    assert linked is not None and linked.count(b"<a id='x'></a></body>") == 1
    assert compat.with_backlink(b"<html>no end</html>", b"<a></a>") is None
