"""The parts of benchmarks/tp.py, one module each (the script is their command line and runs them in order)."""
