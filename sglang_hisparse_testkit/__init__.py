"""Test-bed helpers shipped with the package (opt-in; nothing here runs in a normal server)."""
