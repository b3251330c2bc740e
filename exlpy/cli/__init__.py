"""The `exlpy` command line: generate, plan, bench."""
