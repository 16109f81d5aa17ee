"""Hosted-provider adapters: one module per provider over one HTTP client.

Each adapter renders the gateway's chat call into the provider's wire format
(the bytes that are hashed are the bytes that are sent) and parses answers,
streamed or not, back into text deltas and one normalized usage.
"""
