"""The manifest: a pure library over cacheable units (vBlocks).

No I/O, no clocks, no asyncio; values in, plans and records out.
"""
