"""What a user calls and gets back: the import, ZeroConfig, and zerolite's own error for
each mistake at the API and on the command line."""
