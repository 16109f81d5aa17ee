"""A provider emulator: Anthropic, OpenAI, Gemini and DeepSeek wire formats and caching rules.

Run it with ``python -m loadtests.emulator --port N``.  See ``app.py``.
"""
