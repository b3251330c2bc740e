"""The bundled demo model (0.9 MB), used by the CLI when no model directory is given."""

from pathlib import Path

DEMO_MODEL_DIR = str(Path(__file__).resolve().parent / "aidreams260K")
