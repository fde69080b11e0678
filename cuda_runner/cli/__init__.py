"""The command line: parses arguments, calls the library, renders results. Nothing imports it."""
