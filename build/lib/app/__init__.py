"""slotserve: a text-generation server with continuous batching."""

__version__ = "0.1.0"
