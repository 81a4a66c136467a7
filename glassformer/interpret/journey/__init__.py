"""The token-level journey: one forward pass, every intermediate tensor, in one HTML page."""

from .collect import collect_journey
from .render import render_html, summary, write_html

__all__ = ["collect_journey", "render_html", "summary", "write_html"]
