"""predispatch's release, written into every saved file (serialize/archive.py) and shown as
`predispatch.__version__`."""

__version__ = "0.1.0"
