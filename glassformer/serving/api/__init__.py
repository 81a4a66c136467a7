"""An OpenAI-compatible HTTP server over the serving engine (app.py)."""
