"""Inbound SMTP (our SMTP server): the accept step's decisions in `handler`, the sans-I/O
protocol core in `core`, the asyncio transport in `transport`, the guard, limits, AUTH, TLS,
DATA parsing and long lines in modules of their own.

Docstring only: import from the modules (importing any relay.inbound module runs this
file; tests/importgraph.py).
"""
