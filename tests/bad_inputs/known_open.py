KNOWN_OPEN: set[tuple[str, str, str, str]] = set()
