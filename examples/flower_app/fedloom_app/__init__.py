"""fedloom as a Flower App: the run is fedloom_app/config.yaml (overridden by the run config's
``fedloom.*`` keys)."""

from pathlib import Path

CONFIG = Path(__file__).with_name("config.yaml")
