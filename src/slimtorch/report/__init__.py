"""Terminal rendering shared by commands: byte formatting and rich tables."""
