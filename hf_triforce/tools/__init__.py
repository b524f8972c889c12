"""Tools built on the library, apart from the core: assets, bench, demo, needle, CLI (`hf-triforce ...`)."""
