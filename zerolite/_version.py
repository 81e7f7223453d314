__version__ = "0.1.0"
"""The installed zerolite's version (PEP 440), as ``zerolite --version`` prints it."""
