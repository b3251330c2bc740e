"""The parts of benchmarks/tabbyapi.py, one module each (the script is their command line): `environment` (the
virtual environment, TabbyAPI's dependencies, the exllamav2 alias), `server` (TabbyAPI's config and LoRA
fixture, its process started, awaited and stopped), `checks` (what is driven against the running server, and
their rows), `report` (the results file)."""
