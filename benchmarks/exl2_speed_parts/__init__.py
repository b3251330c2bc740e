"""The parts of benchmarks/exl2_speed.py, one module each (the script is their command line)."""
